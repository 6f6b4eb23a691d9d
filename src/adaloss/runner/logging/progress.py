"""The terminal progress bar: iterations, train loss and accuracy, loss scale, images per second."""

from __future__ import annotations

import sys
from typing import IO, Any

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


#: The bar itself never gets narrower than this many characters; what does not fit beside it is left out.
MIN_BAR = 10
_LAYOUTS = (  # richest first; {stats} is filled in, most important statistic first
    "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}] {stats}",
    "{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}] {stats}",
    "{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{remaining}] {stats}",
)


class _FittingBar(tqdm):
    """A tqdm bar whose layout is chosen for the width at each refresh (``dynamic_ncols``).

    tqdm itself keeps its layout and squeezes the bar, then cuts the line at the terminal's edge: at 80
    columns a long run name and postfix left a one-character bar and ``loss=``. Here the line keeps as many
    statistics as fit (loss first, then accuracy, scale, throughput) beside a bar of at least
    :data:`MIN_BAR` characters, in the richest layout of :data:`_LAYOUTS` that allows it. Cost: the line
    is formatted a few times per refresh (tqdm refreshes at most every 0.1 s).
    """

    stats: tuple[str, ...] = ()

    @property
    def format_dict(self) -> Any:
        d = super().format_dict
        if not isinstance(d, dict) or d.get("total") is None:
            return d
        d = dict(d)
        width, desc, stats = d.get("ncols"), d.get("prefix") or "", list(self.stats)
        for kept in range(len(stats), -1, -1):  # statistics before the name and the rate
            for layout in _LAYOUTS:
                fmt = self._fill(layout, desc, stats[:kept])
                if width is None or self._length(d, fmt) + MIN_BAR <= width:
                    d["bar_format"] = fmt
                    return d
        d["bar_format"] = "{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}"
        return d

    @staticmethod
    def _fill(layout: str, desc: str, stats: list[str]) -> str:
        def literal(text: str) -> str:
            return text.replace("{", "{{").replace("}", "}}")

        return layout.replace("{desc}", literal(desc)).replace("{stats}", literal(" ".join(stats))).rstrip()

    def _length(self, d: dict[str, Any], fmt: str) -> int:
        return len(self.format_meter(**{**d, "bar_format": fmt.replace("{bar}", ""), "ncols": None}))


class ProgressBar:
    """A tqdm bar over the run's iterations with the latest training statistics beside it.

    ``enabled=False`` makes every method a no-op; so does a stderr that is not a terminal (a log file or
    CI would fill with carriage returns; the trainer's log lines report progress there). The layout adapts
    to the terminal's width (:class:`_FittingBar`): the bar keeps at least :data:`MIN_BAR` characters and
    statistics that do not fit are left out, the least important first. ``file`` and ``ncols`` fix the
    output and width (tests render the bar at 80 columns). Updating the statistics costs a string format;
    it is called only on logging steps, where they have been synced anyway.
    """

    def __init__(
        self,
        total: int,
        desc: str,
        enabled: bool = True,
        file: IO[str] | None = None,
        ncols: int | None = None,
    ) -> None:
        self._bar = _FittingBar(
            total=total,
            desc=desc,
            unit="it",
            dynamic_ncols=ncols is None,
            ncols=ncols,
            # None: tqdm turns itself off off a terminal; a given file is always drawn on
            disable=(None if file is None else False) if enabled else True,
            file=file if file is not None else sys.stderr,
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
        """Replace the statistics: train loss, train accuracy (%; None for tasks without one, such as
        detection), loss scale, throughput."""
        stats = [f"loss {loss:.3f}"]
        if accuracy is not None:
            stats.append(f"acc {accuracy:.1f}%")
        stats += [f"scale {format_scale(scale)}", f"{images_per_s:.0f} img/s"]
        self._bar.stats = tuple(stats)

    def render(self) -> str:
        """The bar's current line, as the terminal would show it."""
        return str(self._bar)

    def close(self) -> None:
        self._bar.close()
