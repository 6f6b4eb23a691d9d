"""Number formats, rounding, and the CPU emulation of low-precision training."""

from adaloss.numerics.formats import FORMATS, FloatFormat, get_format, round_generic, round_to_format

__all__ = ["FORMATS", "FloatFormat", "get_format", "round_generic", "round_to_format"]
