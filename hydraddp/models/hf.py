"""Hugging Face transformers models built from their config class: random weights, nothing downloaded.

``model=hf_causal_lm`` builds, e.g., a small Llama. Its ``_no_split_modules`` (``LlamaDecoderLayer``) gives FSDP one
unit per decoder layer (``policies.declared_blocks``); its output's ``.loss`` is what ``task=causal_lm`` uses.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(f"model=hf_causal_lm needs Hugging Face transformers ({exc}): "
                          "pip install 'hydraddp[models]'") from None
    return transformers


def causal_lm(architecture: str = "llama", attn_implementation: str = "sdpa", config_dir: str | None = None,
              **config: Any) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` of ``architecture`` (a transformers ``model_type``: llama, gpt2, qwen2,
    mistral, ...) with ``config`` as its config class's keywords (sizes, vocabulary). With ``config_dir`` (a model
    directory, ``model.pretrained``), its ``config.json`` with ``config`` on top: the architecture, not the weights
    (``hydraddp.train.pretrained`` loads those into the shards)."""
    transformers = _transformers()
    try:
        model_config = (pretrained_config(config_dir, **config) if config_dir is not None
                        else transformers.AutoConfig.for_model(architecture, **config))
    except ValueError as exc:
        raise ValueError(f"model.architecture={architecture!r}: {exc}") from None
    # fp32 master weights whatever dtype a pretrained config.json names: precision= decides what computes in what.
    return transformers.AutoModelForCausalLM.from_config(model_config, attn_implementation=attn_implementation,
                                                         dtype=torch.float32)


def pretrained_config(path: Any, **config: Any) -> Any:
    """The transformers config of a model directory, read from its ``config.json`` alone (nothing downloaded)."""
    return _transformers().AutoConfig.from_pretrained(str(path), local_files_only=True, **config)
