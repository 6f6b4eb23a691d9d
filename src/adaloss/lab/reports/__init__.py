"""Reports from finished runs: the paper's tables and figures, and a summary and figures of any sweep.

* :mod:`adaloss.lab.reports.runs`: reading run folders (``metrics.json``, ``.hydra/``, ``telemetry.jsonl``)
  and W&B projects.
* :mod:`adaloss.lab.reports.tables`: the paper's Tables 1-5 (``scripts/make_tables.py``, ``make tables``).
* :mod:`adaloss.lab.reports.sweeps`: a table per sweep, whatever it ran.
* :mod:`adaloss.lab.reports.figures`: the paper's Figures 1 and 4 and per-layer underflow and loss-scale
  figures of any sweep with telemetry (``scripts/make_figures.py``, ``make figures``).
* :mod:`adaloss.lab.reports.claims`: a verdict per claim of the paper from the mini reproduction's claims runs
  (``python -m adaloss.lab.reports.claims``, ``make reproduce-claims``).

The scripts are thin wrappers around :func:`adaloss.lab.reports.tables.main` and
:func:`adaloss.lab.reports.figures.main`.
"""
