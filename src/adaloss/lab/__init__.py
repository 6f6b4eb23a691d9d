"""The lab: measurements and documents built on the library and the runner.

* :mod:`adaloss.lab.fp8`: loss scalers crossed with FP8 gradient quantizers (``scripts/fp8_lab.py``,
  ``make fp8-lab``).
* :mod:`adaloss.lab.root_scale`: the adaptive scaler's root scale alpha_{N+1}, fixed, dynamic or adaptive
  (``scripts/root_scale.py``).
* :mod:`adaloss.lab.underflow`: per-layer activation-gradient underflow of one telemetry step under each
  scaler, on the CNNs (``scripts/underflow_table.py``) and the tiny GPT (``scripts/lm_underflow.py``).
* :mod:`adaloss.lab.attention_betas`, :mod:`adaloss.lab.lm_runs`: the attention-product and language-model
  labs.
* :mod:`adaloss.lab.bench` (``make bench``), :mod:`adaloss.lab.reports` (tables and figures from run folders),
  :mod:`adaloss.lab.docgen` (generated regions of the docs), :mod:`adaloss.lab.gpucheck` (``make gpu-check``)
  and :mod:`adaloss.lab.results_check` (``make results-check``).
"""
