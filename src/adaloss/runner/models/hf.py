"""Hugging Face transformers language models built from bundled config files (nothing downloaded).

``python train.py model=hf_gpt2 dataset=pystdlib scaler=adaptive`` trains ``GPT2LMHeadModel`` from
``configs/model/hf/gpt2_tiny.json`` (``model=hf_llama``: ``LlamaForCausalLM`` with grouped-query attention
from ``llama_tiny.json``; ``model=hf_bert``: ``BertForMaskedLM`` from ``bert_tiny.json``, trained as a
masked language model, see :func:`masked_lm`). The vocabulary and the context follow the dataset, as for
``model=gpt``. The
adaptive scaler captures these models with ``torch.export`` (torch.fx cannot trace them), so its points
and per-layer telemetry carry the transformers modules' names (``transformer.h.0.attn.c_attn``).

transformers is an optional dependency (``pip install 'adaloss[hf]'``): it is imported when such a model
is built, never by ``import adaloss``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from adaloss.errors import ConfigError

__all__ = ["causal_lm", "config_path", "mask_token_id", "masked_lm"]

#: the keys under which transformers configs give the longest sequence a model takes
_POSITION_KEYS = ("n_positions", "max_position_embeddings")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "the model is a Hugging Face transformers model, but transformers is not installed: "
            "pip install 'adaloss[hf]' (or pip install 'transformers>=5.24,<6'), or choose model=gpt"
        ) from None
    transformers.logging.set_verbosity_error()  # config notes on token ids of the tiny vocabularies
    return transformers


def config_path(config: str) -> Path:
    """A bundled config (``gpt2_tiny.json`` in ``configs/model/hf/``) or a path to a config file."""
    from adaloss.runner.models import _config_dir

    path = Path(config).expanduser()
    for candidate in (path, _config_dir() / "model" / "hf" / config):
        if candidate.is_file():
            return candidate
    bundled = sorted(p.name for p in (_config_dir() / "model" / "hf").glob("*.json"))
    raise ConfigError(
        f"model.config={config!r} is neither a bundled transformers config ({', '.join(bundled)}) nor a "
        "file: e.g. model.config=gpt2_tiny.json"
    )


def _config(
    config: str, vocab_size: int | None, block_size: int | None, attn_implementation: str, **fields_: Any
) -> Any:
    """The transformers config of the file ``config`` (:func:`config_path`; its ``model_type`` picks the
    class) with ``vocab_size`` tokens, room for ``block_size`` positions, ``use_cache=False`` and
    ``fields_`` (``mask_token_id``) on top."""
    transformers = _transformers()
    fields = json.loads(config_path(config).read_text())
    if "model_type" not in fields:
        raise ConfigError(f'model.config={config}: the file names no model_type (e.g. "model_type": "gpt2")')
    if attn_implementation not in ("eager", "sdpa"):
        raise ConfigError(
            f"model.attn_implementation must be eager or sdpa, got {attn_implementation!r}; "
            "e.g. model.attn_implementation=sdpa"
        )
    if vocab_size is not None:
        fields["vocab_size"] = int(vocab_size)
    for key in _POSITION_KEYS:
        if key in fields and block_size is not None:
            fields[key] = max(int(fields[key]), int(block_size))
    fields["use_cache"] = False
    made = transformers.AutoConfig.for_model(**{**fields, **fields_})
    made._attn_implementation = attn_implementation
    return made


def causal_lm(
    config: str,
    vocab_size: int | None = None,
    block_size: int | None = None,
    attn_implementation: str = "sdpa",
) -> nn.Module:
    """A transformers causal language model (``AutoModelForCausalLM``) from the config file ``config``
    (:func:`config_path`; its ``model_type`` picks the class), with ``vocab_size`` tokens and room for
    ``block_size`` positions, and ``use_cache=False`` (a training forward returns no key/value cache;
    ``generate(use_cache=True)`` still uses one). ``attn_implementation``: ``eager`` or ``sdpa``."""
    made = _config(config, vocab_size, block_size, attn_implementation)
    return _transformers().AutoModelForCausalLM.from_config(made)


def mask_token_id(vocab_size: int) -> int:
    """The id of ``[MASK]`` for data of ``vocab_size`` tokens: the one after the data's last token (a
    masked language model's vocabulary is the data's plus this one)."""
    return int(vocab_size)


def masked_lm(
    config: str,
    vocab_size: int | None = None,
    block_size: int | None = None,
    attn_implementation: str = "sdpa",
) -> nn.Module:
    """A transformers masked language model (``AutoModelForMaskedLM``: ``BertForMaskedLM`` for
    ``bert_tiny.json``) from the config file ``config``, for data of ``vocab_size`` tokens: its vocabulary
    has one token more, ``[MASK]`` (:func:`mask_token_id`; the config's ``mask_token_id`` says which),
    and room for ``block_size`` positions. The language-model task masks the inputs and counts the loss
    on the masked positions only (``task.masking``, which the config's ``model.masking`` sets)."""
    vocab = None if vocab_size is None else int(vocab_size) + 1
    mask = {} if vocab_size is None else {"mask_token_id": mask_token_id(vocab_size)}
    made = _config(config, vocab, block_size, attn_implementation, **mask)
    return _transformers().AutoModelForMaskedLM.from_config(made)
