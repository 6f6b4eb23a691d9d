"""The FP8 scaling-recipes lab (``scripts/fp8_lab.py``, ``make fp8-lab``): loss scalers crossed with gradient
quantizers, against FP32 and BF16.

    python scripts/fp8_lab.py                 # every cell, 5 seeds (make fp8-lab), then the table and figures
    python scripts/fp8_lab.py --report-only   # rebuild the table and figures from the finished runs
    python scripts/fp8_lab.py --smoke --out /tmp/fp8   # seconds: two tiny runs per cell of a few cells

Two tasks (``--models``): the tiny GPT on the standard-library corpus (``model=gpt dataset=pystdlib``, final
validation loss, lower is better) and ResNet-20 on digits (``model=resnet20 dataset=digits``, test accuracy
in %, higher is better). For each, the cells are FP32, BF16 and, for gradients stored in E5M2 and in E4M3
(``precision=fp8_e5m2``, ``fp8_e4m3``), every loss scaler in {none, dynamic, adaptive} crossed with every
gradient quantizer in {global (``precision.grad_scaling=none``: the loss scale only), tensor_current,
tensor_delayed, mx_block with ceil rounding}. Each run is short (:data:`MODELS` lists the overrides; the
docs page states them) and runs in this process through ``adaloss.runner.engine.train``, so torch starts once.

Every finished run appends one line to ``<out>/runs_<model>.jsonl``; a later call skips the runs it finds
there (resumable; the two models can run in two processes at once). A file made with other run settings is
an ``error:`` line, as its rows would not be comparable. Run folders go to ``--runs-dir`` (not committed).

The report (``<out>/fp8_lab.md``, ``.csv``, ``.json``, ``<out>/fp8_gap.png``, ``<out>/fp8_layers.png``):
each cell's final metric minus FP32's with the same seed (the runs pair by seed: same initial weights, same
data order), its mean and 95% t-interval over the seeds; the effect of each loss scaler against none under
the same quantizer (paired by seed, the paper's question: does a scale on top of the quantizer's help?); and

The modules: :mod:`~adaloss.lab.fp8.cells` (tasks and cells), :mod:`~adaloss.lab.fp8.runs` (running,
the runs files), :mod:`~adaloss.lab.fp8.stats` (gaps, intervals, contrasts), :mod:`~adaloss.lab.fp8.tables`
(Markdown and CSV), :mod:`~adaloss.lab.fp8.figures`, :mod:`~adaloss.lab.fp8.report` (the report and the
docs region) and :mod:`~adaloss.lab.fp8.cli` (the command line).
"""
