"""Adaptive loss scaling internals: the scale rules (Algorithms 4 and 5), the autograd ops (Algorithm 3) and
the torch.fx rewrite, and the report of what it covered (:class:`Coverage`)."""

from adaloss.adaptive.coverage import Coverage
from adaloss.adaptive.ops import AdaptiveState
from adaloss.adaptive.rules import (
    RULES,
    ScaleRule,
    backward_fan_in,
    branch_loss_scale,
    gemm_loss_scale,
)
from adaloss.adaptive.transform import AdaptiveTransformError, attach_adaptive

__all__ = [
    "RULES",
    "AdaptiveState",
    "AdaptiveTransformError",
    "Coverage",
    "ScaleRule",
    "attach_adaptive",
    "backward_fan_in",
    "branch_loss_scale",
    "gemm_loss_scale",
]
