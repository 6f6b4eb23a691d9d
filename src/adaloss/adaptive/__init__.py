"""Adaptive loss scaling internals: the autograd ops (Algorithms 3-5) and the torch.fx rewrite."""

from adaloss.adaptive.ops import AdaptiveState, branch_loss_scale, gemm_loss_scale
from adaloss.adaptive.transform import AdaptiveTransformError, attach_adaptive

__all__ = [
    "AdaptiveState",
    "AdaptiveTransformError",
    "attach_adaptive",
    "branch_loss_scale",
    "gemm_loss_scale",
]
