"""Small helpers the runner needs: seeding, device selection, building a part from its config group
(``targets``). The checks on a composed config are :mod:`adaloss.runner.engine.config`."""

from adaloss.runner.utils.device import select_device
from adaloss.runner.utils.seed import seed_everything

__all__ = ["seed_everything", "select_device"]
