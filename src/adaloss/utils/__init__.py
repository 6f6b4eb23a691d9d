"""Small helpers the engine needs: seeding, device selection, config checks."""

from adaloss.utils.config import resolved_config, schedule_length, validate_config
from adaloss.utils.device import select_device
from adaloss.utils.seed import seed_everything

__all__ = ["resolved_config", "schedule_length", "seed_everything", "select_device", "validate_config"]
