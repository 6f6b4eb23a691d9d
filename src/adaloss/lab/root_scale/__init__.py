"""The root scale alpha_{N+1} of the adaptive scaler (``scripts/root_scale.py``): ``scaler.root`` = fixed (the
paper's), dynamic or adaptive.

    python scripts/root_scale.py [--seeds 0,1,2,3,4] [--tasks gpt,ssd,resnet20] [--out results/root]
    python scripts/root_scale.py --from-json      # the tables again from results/root/root_scale.json

For each task, each seed and each root (interleaved: seed by seed, the three roots one after the other), one
short run of ``python train.py <task> precision=fp16 scaler=adaptive scaler.root=<root>`` (composed as
``train.py`` composes it, run by ``adaloss.runner.engine.train`` in this process, single-threaded), then a
cost benchmark in the same process. Recorded per run: the task's validation metric, the per-layer underflow of
the last telemetry step (the runs' own telemetry), alpha_{N+1} at the end, skipped steps, and how many steps
recomputed the betas. The tasks (short reductions of the dataset recipes, chosen to fit a CPU budget):

* ``gpt``: ``model=gpt dataset=pystdlib``, 100 of its 400 steps (validation loss, lower is better), the
  betas recomputed every 10 steps (the dataset has no ``update_every`` of its own; the generic 100 would
  leave one recompute in the run, and ``root=adaptive`` no measurement that acts within it);
* ``ssd``: ``model=ssd512 dataset=shapes`` at 128x128 and 1/8 width, 30 of its 1500 steps, 64 test
  images (VOC07 mAP %);
* ``resnet20``: ``model=resnet20 dataset=digits``, 40 of its 200 steps (test accuracy %).

``root=dynamic`` starts at GradScaler's 2**16 (``scaler.init_scale=65536``) with its growth interval 2000
(no growth within these runs: it backs off to the largest scale that does not overflow); the other two start
at 1. Every other setting is the task's (``adaptive_recipe``: bounds, ``update_every``).

Cost per step: for each task, the three roots' models (same weights, same batch) take turns, ``--bench-steps``
steps each, ``--bench-rounds`` times, with ``update_every=1`` (every step recomputes the betas and, under
``adaptive``, measures the loss gradient: the root options' largest cost); the median step time of each
root divided by fixed's. The extra recomputes a root causes at the task's own ``update_every`` are in the
runs' recompute counts.

Writes ``<out>/root_scale.json`` (every run, the benchmark, the machine) and ``<out>/root_scale.md`` (the
tables: mean and 95% t-interval over the seeds; the difference to fixed paired by seed with its 95%
t-interval, and whether the interval excludes 0).

The modules: :mod:`~adaloss.lab.root_scale.tasks` (roots, tasks, the run's config),
:mod:`~adaloss.lab.root_scale.runs` (the runs and the cost benchmark), :mod:`~adaloss.lab.root_scale.tables`
(the tables and their statistics) and :mod:`~adaloss.lab.root_scale.cli` (the command line).
"""
