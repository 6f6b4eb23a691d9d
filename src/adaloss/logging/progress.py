"""The terminal progress bar: iterations, train loss and accuracy, loss scale, images per second."""

from __future__ import annotations

import sys

from tqdm import tqdm


def format_scale(scale: float | dict[str, float] | None) -> str:
    """A loss scale for a narrow column: ``65536``, or ``min..max`` over layers for a layer-wise scaler."""
    if scale is None:
        return "-"
    if isinstance(scale, dict):
        if not scale:
            return "-"
        return f"{min(scale.values()):.3g}..{max(scale.values()):.3g}"
    return f"{scale:.6g}"


class ProgressBar:
    """A tqdm bar over the run's iterations with the latest training statistics as its postfix.

    ``enabled=False`` makes every method a no-op; so does a stderr that is not a terminal (a log file or
    CI would fill with carriage returns; the trainer's evaluation lines still report progress there).
    Updating the postfix costs a string format; it is called only on logging steps, where the statistics
    have been synced anyway.
    """

    def __init__(self, total: int, desc: str, enabled: bool = True) -> None:
        self._bar = tqdm(
            total=total,
            desc=desc,
            unit="it",
            dynamic_ncols=True,
            disable=None if enabled else True,  # None: tqdm turns itself off off a terminal
            file=sys.stderr,
            leave=True,
        )

    def update(self, n: int = 1) -> None:
        self._bar.update(n)

    def show(
        self,
        loss: float,
        accuracy: float | None,
        scale: float | dict[str, float] | None,
        images_per_s: float,
    ) -> None:
        """Replace the postfix: train loss, train accuracy (%; None for tasks without one, such as
        detection), loss scale, throughput."""
        postfix = {"loss": f"{loss:.3f}"}
        if accuracy is not None:
            postfix["acc"] = f"{accuracy:.1f}%"
        postfix["scale"] = format_scale(scale)
        postfix["img_s"] = f"{images_per_s:.0f}"
        self._bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        self._bar.close()
