"""Labs: measurements beyond the paper's experiments, each a command line in ``scripts/``
over a subpackage here.

* :mod:`adaloss.labs.fp8`: loss scalers crossed with FP8 gradient quantizers (``scripts/fp8_lab.py``,
  ``make fp8-lab``).
* :mod:`adaloss.labs.root_scale`: the adaptive scaler's root scale alpha_{N+1}, fixed, dynamic or adaptive
  (``scripts/root_scale.py``).
* :mod:`adaloss.labs.underflow`: per-layer activation-gradient underflow of one telemetry step under each
  scaler, on the CNNs (``scripts/underflow_table.py``) and the tiny GPT (``scripts/lm_underflow.py``).
"""
