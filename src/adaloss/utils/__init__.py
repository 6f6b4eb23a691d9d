"""Small helpers the runner needs: seeding, device selection, building a part from its config group
(``targets``). The checks on a composed config are :mod:`adaloss.engine.config`."""

from adaloss.utils.device import select_device
from adaloss.utils.seed import seed_everything

__all__ = ["seed_everything", "select_device"]
