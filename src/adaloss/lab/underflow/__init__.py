"""Per-layer activation-gradient underflow of one telemetry step under each loss scaler: two tables.

* The CNNs' (``scripts/underflow_table.py``): :mod:`~adaloss.lab.underflow.settings` (what it measures),
  :mod:`~adaloss.lab.underflow.measure` (one step, the training before it, the comparison),
  :mod:`~adaloss.lab.underflow.table` (CSV and Markdown), :mod:`~adaloss.lab.underflow.cli`.
* The tiny GPT's (``scripts/lm_underflow.py``): :mod:`~adaloss.lab.underflow.lm` (its scalers and table)
  and :mod:`~adaloss.lab.underflow.lm_cli`; it measures with the same
  :func:`~adaloss.lab.underflow.measure.measure`.

**The CNN table:** per-layer activation-gradient underflow with no scaling, fixed scale 128 and adaptive
scaling (both rules).

The README's numerical-effect table. The claim checked: in emulated FP16, on ResNet-110 and on a VGG-style
network without batch normalization, the per-layer underflow rates with adaptive scaling are far below those
of no scaling, and how they compare with fixed scale 128 under each scale rule (``reference``, the authors'
code, and ``paper``, the text; see ``src/adaloss/adaptive/rules.py``).

For each model, with a fixed seed and one fixed batch of the bundled ``digits`` data, one telemetry step
(forward, loss, scaled backward; no optimizer step) is measured under each scaler (``none``, ``fixed`` 128,
``adaptive`` under the reference rule and ``adaptive_paper`` under the paper's, both with ``update_every=1``,
so their betas come from this very batch, and the reference rule with the authors' CIFAR bounds, 128 and
4096) from the same weights, in three gradient regimes:

* ``init_fp16``: the freshly initialized model, FP16. The loss is large, so are the gradients; the paper's
  Figure 4a shows adaptive scales far below 128 on ResNets here, so fixed 128 is expected to win.
* ``trained_fp16``: the model after ``--train-steps`` of FP32 SGD on digits (momentum 0.9), so the loss
  and hence the gradients are small, as late in training where underflow bites. All three scalers start
  from a deep copy of that same trained state.
* ``trained_fp8``: the same trained state with ``precision=fp8_e5m2`` (FP16 activations, FP8 e5m2
  gradients whose smallest subnormal is 2**-16), where per-layer scaling matters most.

The underflow rate of a layer is the fraction of the elements of the gradient with respect to its output
that are non-zero before rounding to the gradient format and zero after (``adaloss.telemetry``); with a
scaler it is measured on the *scaled* gradient, which is what is stored.

Writes ``results/underflow/<model>_<regime>.csv`` (per layer: the three rates and the adaptive alpha) and
``results/underflow/underflow.json``; prints one Markdown summary table. Whatever the numbers say is printed,
including regimes where adaptive scaling loses.

Cost: dominated by the FP32 training: about 4 minutes in all on a busy 2-core machine with one thread
(ResNet-110: 80 steps, about 140 s; VGG: 150 steps, about 55 s); the nine measured steps per model take
seconds.

**The tiny GPT's table:** per-layer activation-gradient underflow of the tiny GPT under none, fixed,
dynamic and adaptive scaling.

    .venv/bin/python scripts/lm_underflow.py [--seed 0] [--steps 400] [--fixed-scale 1024] [--batch N]
        [--out results/lm/underflow] [overrides]

The README's transformer underflow table. The model and data are what ``python train.py model=gpt
dataset=pystdlib <overrides>`` builds (composed as ``scripts/lm_runs.py`` does): the model at initialization
(the trainer's seed and build order), and the same model after ``--steps`` FP32 steps of the dataset's recipe
(``train()`` with ``precision=fp32``, so AdamW, warm-up and cosine, clipping; 400 steps is the whole recipe).
From each set of weights, one telemetry step (forward, loss, scaled backward, no optimizer step; the
``measure`` of the CNN table) on one fixed training batch, in emulated FP16 and with FP8 e5m2
gradients (``precision=fp16`` / ``precision=fp8_e5m2``), under each scaler:

* ``none``: alpha 1 everywhere;
* ``fixed``: ``--fixed-scale`` (default 1024: the adaptive recipe's ``accum_upper_bound`` on this task, the
  largest scale the adaptive scaler may give any layer, applied to all of them alike);
* ``dynamic``: GradScaler's rule from its initial 2**16 (``configs/scaler/dynamic.yaml``), halved while the
  step overflows on these weights and this batch: the scale a run from here would train with;
* ``adaptive``: ``configs/scaler/adaptive.yaml`` (reference rule, the task's bounds 16 / 1024, attention's
  product betas) with ``update_every=1``, so its betas come from this batch.

The underflow rate of a layer is the share of the non-zero elements of the gradient with respect to its
output that the gradient format flushes to zero (``adaloss.telemetry``), measured on the scaled gradient,
which is what is stored. Attention's products (``<block>.attn.scores``: the recomputed ``dS``;
``<block>.attn.values``) have telemetry only through the adaptive transform's points, so only the adaptive
column has them. The table gives each kind of layer's mean over the blocks; ``<out>/underflow.json`` every
layer's rate, the adaptive alphas, the scales and the training run's validation loss; ``<out>/table.md`` the
table. Cost: the FP32 training (about a minute on one busy core for 400 steps) and 16-20 steps of a batch.
"""
