"""Step-time ratios of the training configurations, measured interleaved in one process (``make bench``).

What it answers: how much does emulated FP16 cost over FP32, each loss scaler over no scaling, underflow
telemetry over none, and the adaptive scaler over the dynamic one (at ``update_every`` 1 and 100, the
paper's 27% and 0.27%), for the CIFAR ResNets 20/56/110 on synthetic 32x32 inputs; and, informational, what
each gradient quantizer (``precision.grad_scaling``: tensor_current, tensor_delayed, mx_block) costs over
the global-scale FP8 E4M3 emulation, all under dynamic scaling (``fp8_*_over_global``).

Why ratios, and why interleaved: the lab machines are shared (other test suites compete for the 2 cores),
so an absolute step time says more about the neighbours than about the code, and two numbers taken minutes
apart are not comparable. Every configuration of one model is therefore built in this process and they take
turns step by step: a *round* is a few cycles in which every configuration runs one step, each cycle in a
fresh random order (seeded; never the same model twice in a row), plus one cycle of the extra step kinds;
each ratio is formed from the round's mean step times, and the table reports the median of the per-round
ratios with its interquartile range. A load change mid-run then moves numerator and denominator together.
An A/A row (two identical FP16 configurations) shows the noise floor of a ratio between two
configurations: a target tighter than that spread is not resolved by one run, and the table prints the
measurement as it is rather than rounding it to fit. (The amortized telemetry row is far less noisy: both
its step kinds run on one configuration and the telemetry step weighs 1%.)

Copies (``--replicas N``): N separately built copies of every configuration take turns like the others,
and all copies' steps enter each round's mean. A model's step time might depend on where its tensors
landed in memory, which more rounds of the same model would not average out; more copies would. The table
then adds each copy's A/A ratio to copy 0, so a run shows how far two identical models differ (ResNet-110,
2 copies, 20 rounds: medians 0.999x and 1.003x, inside the per-round noise).

A *step* is forward + loss + scaled backward + ``scaler.step`` + ``scaler.update`` + ``zero_grad``, timed
with ``time.perf_counter`` (the CPU runs synchronously; ``--clock cpu``: ``time.process_time``, see below)
after warm-up steps. Amortized ratios combine two
step kinds measured in the same round: telemetry at ``every=100`` is ``(t_tel + 99 t) / (100 t)`` and
adaptive at ``update_every=100`` is ``(t_recompute + 99 t_reuse) / (100 t_dynamic)``; the recompute step is
requested through the scaler's own "recompute on the next step" flag (the one an overflow sets), and each
adaptive step's actual kind is read back from ``scaler.last_pass``, so a natural recompute step is
never counted as a reuse step.

Threads: one by default (``--threads 0`` keeps torch's default, ``--threads 2`` uses both cores). On a
shared 2-core machine a 2-thread OpenMP region stalls whenever either thread is preempted: measured here at
load 5, ResNet-20 FP16 steps took 0.5-4 s with 2 threads against 0.33-0.35 s with 1, and the per-round
ratios spread from 1.02x to 2.95x (dynamic / none). One thread keeps the ratios reproducible. Its ratios are
somewhat *lower* than a 2-thread run on an idle machine would give: the emulation's per-op Python overhead
is fixed while the arithmetic it is compared with runs on one core instead of two. The header names the
thread count so a reader knows which one was measured.

Clock: ``--clock wall`` (default) times steps with ``time.perf_counter``; ``--clock cpu`` with
``time.process_time``, the CPU time of this process. With one thread and synchronous CPU kernels the two
agree on an idle machine, but under load the CPU clock leaves out the time the process waited for a core,
the largest source of noise here. Both clocks timed the same steps of one 12-round ResNet-20 run at load
~3.5: the per-round adaptive update_every=1 / dynamic ratio had p25-p75 1.043-1.186 by the wall clock and
1.053-1.074 by the CPU clock. The CPU clock still includes the slowdown from sharing caches and memory
bandwidth with the neighbours, so it does not make a loaded machine an idle one.

Allocator and kernels: :func:`adaloss.lab.bench.cli.main` first applies
:func:`adaloss.runner.utils.allocator.tune_cpu_allocator` (as the trainer does on the CPU), so no
configuration pays for glibc's malloc giving memory back to the kernel and faulting it in again every step;
without it, which configuration took those faults (up to 1.4 million per step) depended on heap layout and
moved ratios by several percent.

Paired runs: ``--configs fp16_dynamic fp16_adaptive_u100`` measures only those configurations (and reports
only the ratios between them), so a comparison of two configurations gets more rounds in the same time and
does not share the heap with five unrelated models.

The tiny GPT (``--gpt on|off|only``): after the ResNets, ``model=gpt`` (4 blocks, width 64, the head tied
to the embedding) on random 64-byte windows takes the same interleaved rounds with dynamic scaling, an
identical copy of it (A/A), and the adaptive scaler at ``update_every=100`` with and without attention's own
betas (``product_betas``). Its goals (issue 22): the amortized adaptive step at most 1.02x a dynamic step,
a recompute step at most 1.25x.
About a minute (``--gpt-budget``); ``--gpt only`` runs it alone (``results/bench/gpt.json``).

The host-bound step, eager and compiled (``--hostbound on|off|only``, issue 34): after the tiny GPT,
:mod:`adaloss.lab.bench.hostbound` times ResNet-20 on two 8x8 images in FP32 on one thread, a step that is
mostly Python and op dispatch as a GPU step is at the sizes ``make gpu-check`` times, eagerly and compiled
(``torch.compile(scaler.attach(model), fullgraph=True)``, ``--hostbound-backend``, Inductor by default;
``none``: eager only), the eager and compiled steps taking turns in the same rounds (``--hostbound-rounds``,
40, within ``--hostbound-budget`` seconds, 120; compiling comes first, 1-5 minutes on the shared 2-core
machine, longer with a cold Inductor cache). Its goals for the compiled steps: adaptive ``update_every=100``
at most 1.05x a dynamic step, ``update_every=1`` at most 1.5x. ``--hostbound only`` runs it alone
(``results/bench/hostbound.json``).

Dispatched ops per step, a GPU-cost proxy (``--opcounts on|off|only``): no GPU is available here, and on
a GPU a step's host cost is largely one kernel launch per dispatched op, so after the timing the script
counts the ATen ops of one dynamic step and of adaptive reuse and recompute steps (ResNet-20 and -110),
under real FP16 autocast on the CPU (the code a GPU runs), and prints them
with their ratios to the dynamic step against issue 22's goals (reuse at most 1.05x, recompute at most
2x), and where the extra ops come from, by op and by calling line. Counts are exact and do not depend on
the batch size or the machine's load, so one small batch suffices (checked each run). See
:func:`adaloss.lab.bench.opcounts.count_step_ops` and :class:`adaloss.lab.bench.opcounts.OpCounter` for what
is counted and how.

Cost: the default run keeps to ``--budget`` seconds (840 s), shared among the models; deeper models get
fewer rounds and fewer steps per round; the tiny GPT keeps to ``--gpt-budget`` (240 s), the host-bound
step's timed rounds to ``--hostbound-budget`` (120 s) after its compiling, and the op counts add about a
minute. ``--quick`` is a seconds-long smoke run (no tiny GPT, host-bound step or op counts). Raw per-step
timings (with their kinds and cycles), every ratio, the host-bound step's times and compile counts, and the
op counts go to ``--out`` (``results/bench/bench.json``; ``--opcounts only``:
``results/bench/opcounts.json``).

Modules: :mod:`~adaloss.lab.bench.specs` (the configurations and ratio definitions),
:mod:`~adaloss.lab.bench.timing` (the runners and interleaved rounds), :mod:`~adaloss.lab.bench.stats` (ratios
per round, medians, A/A between copies), :mod:`~adaloss.lab.bench.hostbound` (the host-bound step, eager and
compiled), :mod:`~adaloss.lab.bench.opcounts` (the dispatched-ops counter), :mod:`~adaloss.lab.bench.report`
(the tables), :mod:`~adaloss.lab.bench.cli` (the command line; ``scripts/bench.py`` calls its ``main``).
"""
