"""The runner: what turns a Hydra config into a training run, on the library.

* :mod:`adaloss.runner.engine`: the composition root (``engine.compose``), the run's admission, the training
  loop, checkpoints, run folders, signals and faults;
* :mod:`adaloss.runner.data` and :mod:`adaloss.runner.models`: the data sets and models the configs name;
* :mod:`adaloss.runner.schemas`: the typed config schemas Hydra validates against;
* :mod:`adaloss.runner.logging` and :mod:`adaloss.runner.metrics`: run logs, W&B, telemetry files, VOC mAP;
* :mod:`adaloss.runner.utils` and :mod:`adaloss.runner.provenance`: ``_target_`` building, seeds, devices, and
  what a run records about the code and the machine.

It needs the ``runner`` extra (Hydra, OmegaConf, W&B, torchvision, ...). It imports the library
(:mod:`adaloss.scalers`, :mod:`adaloss.adaptive`, ...) and never the lab (``docs/architecture.md``, "Layers").
"""
