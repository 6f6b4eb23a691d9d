"""Per-layer underflow telemetry: how much of each activation gradient the training format loses.

For every GEMM layer (conv, linear), named by module path such as ``layer3.2.conv1``, the *activation-gradient
underflow rate* is the fraction of elements of the gradient with respect to the layer's output that are
non-zero before rounding to the format and zero after. In the CPU emulation this is exact: the gradient is
counted just before it is rounded. On CUDA, telemetry steps run through the same emulated path (FP32 compute
plus rounding) instead of real autocast, so the count is honest there too; see
:meth:`adaloss.precision.Precision.autocast`.

Telemetry is sampled on the first iteration and then every ``every`` iterations, so its cost (one extra
comparison pass per probed gradient and one host sync per telemetry step) is negligible in long runs while
short runs still report it.
"""

from __future__ import annotations

from adaloss.errors import ConfigError
from adaloss.numerics.emulation import Probe
from adaloss.numerics.formats import FloatFormat, get_format

__all__ = ["UnderflowMonitor"]


class UnderflowMonitor:
    """Collects per-layer activation-gradient underflow counts on telemetry steps.

    Example::

        monitor = UnderflowMonitor(every=100, fmt="fp16")
        for step, (x, y) in enumerate(loader):
            with precision.autocast(monitor=monitor if monitor.due(step) else None):
                loss = criterion(model(x), y)
            scaler.scale(loss).backward()
            if monitor.due(step):
                rates = monitor.underflow_rates()   # {layer: rate}; one host sync

    Args:
        every (int, optional, default=100): sample the first iteration and every ``every`` after it.
        fmt (str or FloatFormat, optional, default="fp16"): the format whose underflow is counted (for an
            FP32 run this is the format the gradients *would* lose values in).
    """

    def __init__(self, every: int = 100, fmt: str | FloatFormat = "fp16") -> None:
        try:
            every = int(every)
        except (TypeError, ValueError):
            raise ConfigError(f"telemetry.every must be a positive integer, got '{every}'") from None
        if every < 1:
            raise ConfigError(f"telemetry.every must be a positive integer, got {every}")
        self.every = every
        self.fmt = get_format(fmt)
        self._probes: dict[str, Probe] = {}
        self.last_rates: dict[str, float] = {}

    def due(self, step: int) -> bool:
        """Whether iteration ``step`` (0-based) is a telemetry step. No host sync."""
        return step % self.every == 0

    def probe(self, name: str) -> Probe:
        """The probe that counts the gradient of layer ``name`` this step (created on first use)."""
        p = self._probes.get(name)
        if p is None:
            p = self._probes[name] = Probe(self.fmt)
        return p

    def underflow_rates(self) -> dict[str, float]:
        """Per-layer underflow rates of the last telemetry step, in network order; resets the counts.

        Synchronizes host and device once (all counts are stacked and copied together).
        """
        names = [n for n, p in self._probes.items() if p.underflow is not None and p.numel > 0]
        if not names:
            self._probes.clear()
            return {}
        import torch

        counts = torch.stack([self._probes[n].underflow.float() for n in names]).cpu().tolist()
        rates = {n: c / self._probes[n].numel for n, c in zip(names, counts, strict=True)}
        self._probes.clear()
        self.last_rates = rates
        return rates

    @staticmethod
    def mean_rate(rates: dict[str, float]) -> float:
        """Unweighted mean over layers (each layer counts once, as in the paper's per-layer plots)."""
        return sum(rates.values()) / len(rates) if rates else 0.0
