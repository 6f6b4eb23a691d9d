"""The README's "own loop" snippet runs verbatim, with its device string set to the CPU.

The code block is read from README.md at test time, so an edit there is tested. Only two things are
supplied from outside: the device string ``"cuda"`` becomes ``"cpu"`` (PyTorch's real FP16 autocast on the
CPU, the same code path a GPU takes), and ``model``, ``loader`` and ``criterion``, which the README leaves
to the reader, are tiny objects defined here. Everything else (``torch`` included) must come from the
block itself, as it would in a fresh shell.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

README = Path(__file__).resolve().parents[1] / "README.md"
HEADING = "## The adaptive scaler in your own loop"


def own_loop_block() -> str:
    """The first ``python`` code block of the README's own-loop section."""
    text = README.read_text(encoding="utf-8")
    assert HEADING in text, f"README.md lost its section {HEADING!r}"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "the own-loop section has no python code block"
    return blocks[0]


def test_the_block_targets_cuda_and_names_the_cpu_variant() -> None:
    block = own_loop_block()
    assert block.count('"cuda"') == 1, "one device string, so a reader (and this test) changes one place"
    assert '"cpu"' in block  # the CPU variant is shown beside it
    assert "from adaloss.scalers import AdaptiveLossScaler" in block


def test_the_block_runs_verbatim_under_cpu_fp16_autocast() -> None:
    code = own_loop_block().replace('"cuda"', '"cpu"')
    assert "cuda" not in code
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)
    )
    initial = [p.detach().clone() for p in model.parameters()]
    loader = [(torch.randn(4, 3, 6, 6), torch.randint(0, 3, (4,))) for _ in range(3)]
    logits_dtypes = []

    def criterion(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits_dtypes.append(logits.dtype)
        return F.cross_entropy(logits, target)

    namespace = {"model": model, "loader": loader, "criterion": criterion, "__name__": "readme_own_loop"}
    exec(compile(code, "README.md (own loop)", "exec"), namespace)  # noqa: S102

    scaler = namespace["scaler"]
    assert logits_dtypes == [torch.float16] * 3  # real FP16 autocast reached the model, every step
    assert scaler.is_enabled() and scaler.skipped_steps == 0
    # update_every=100: the first step recomputed the scales, the last two reused them, as on a GPU.
    assert not scaler.state.recompute
    params = list(namespace["model"].parameters())
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in params)
    assert all(not torch.equal(p, q) for p, q in zip(params, initial, strict=True))  # every weight trained
    scales = scaler.layer_scales()
    assert len(scales) == 2 and all(math.isfinite(a) and a > 0 for a in scales.values())
