"""The attention-betas lab (``scripts/attention_betas.py``): do attention's products deserve a beta of their
own? Per-layer underflow with and without.

A tiny GPT-style decoder (:class:`~adaloss.lab.attention_betas.model.TinyGPT`: causal
``F.scaled_dot_product_attention``, one fused QKV ``nn.Linear``, the token embedding tied to the output
projection) is trained in FP32 on the bytes of a standard-library source file (read at run time, nothing
downloaded). At initialization and after that training, one step of the adaptive scaler (``update_every=1``)
in emulated FP16 and in FP8 e5m2 gradients, under both rules, measures every GEMM's and every attention
product's activation-gradient underflow (telemetry) with ``scaler.product_betas`` off (alpha passes through
attention) and on (attention gets a beta of its own: Algorithm 4 with the other operand in the weight's
place). Prints one row per setting; writes the per-layer rates as CSV under ``--out``. About a minute on one
CPU core.

The modules: :mod:`~adaloss.lab.attention_betas.model` (the decoder and its data),
:mod:`~adaloss.lab.attention_betas.measure` (one step, a setting's summary and CSV) and
:mod:`~adaloss.lab.attention_betas.cli` (the command line).
"""
