"""Hugging Face transformers models built from their config class: random weights, nothing downloaded.

``model=hf_causal_lm`` builds, e.g., a small Llama. Its ``_no_split_modules`` (``LlamaDecoderLayer``) gives FSDP one
unit per decoder layer (``policies.declared_blocks``); its output's ``.loss`` is what ``task=causal_lm`` uses.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(f"model=hf_causal_lm needs Hugging Face transformers ({exc}): "
                          "pip install 'hydraddp[models]'") from None
    return transformers


def causal_lm(architecture: str = "llama", attn_implementation: str = "sdpa", **config: Any) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` of ``architecture`` (a transformers ``model_type``: llama, gpt2, qwen2,
    mistral, ...) with ``config`` as its config class's keywords (sizes, vocabulary)."""
    transformers = _transformers()
    try:
        model_config = transformers.AutoConfig.for_model(architecture, **config)
    except ValueError as exc:
        raise ValueError(f"model.architecture={architecture!r}: {exc}") from None
    return transformers.AutoModelForCausalLM.from_config(model_config, attn_implementation=attn_implementation)
