"""Our loss scalers in other people's training loops: PyTorch Lightning, Hugging Face Accelerate, timm.

* :mod:`adaloss.integrations.lightning`: precision plugins for ``Trainer(plugins=[...])`` and
  ``Fabric(plugins=[...])`` (needs the ``lightning`` extra);
* :mod:`adaloss.integrations.accelerate`: ``use_scaler(accelerator, scaler, model)`` for
  ``accelerate.Accelerator`` (needs the ``accelerate`` extra);
* :mod:`adaloss.integrations.timm`: ``TimmScaler(scaler)``, in the place of timm's ``NativeScaler`` (needs
  the ``timm`` extra).

Importing this package imports none of these libraries; each submodule imports its own on first import, and
says which extra to install when it is missing. The docs page "Using the scalers in your trainer"
(``docs/trainers.md``) shows each in use.
"""

from __future__ import annotations

__all__: list[str] = []
