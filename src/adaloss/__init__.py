"""adaloss: loss scaling for FP16 training, measured side by side.

The package reproduces "Adaptive Loss Scaling for Mixed Precision Training" (Zhao et al.) and compares its
layer-wise scaler with no scaling, a fixed scale and dynamic backoff. See ``docs/architecture.md``.
"""

__version__ = "0.1.0"
