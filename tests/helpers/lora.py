"""A user's LoRA model: a tiny transformers Llama (built from its config class, nothing downloaded) wrapped with peft's
LoRA, its base frozen and only the adapters trainable. Bring it as any user model: ``model._target_=
tests.helpers.lora.tiny_lora_llama data=tokens task=causal_lm``."""

from __future__ import annotations

from typing import Any

from torch import nn

from hydraddp.models.hf import causal_lm

# The sizes of conf/model/hf_causal_lm.yaml (vocabulary: the bundled text's ASCII codes), so data=tokens fits it.
TINY_LLAMA = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
              "tie_word_embeddings": False}


def tiny_lora_llama(r: int = 4, target_modules: Any = ("q_proj", "v_proj"), **config: Any) -> nn.Module:
    """peft's ``get_peft_model`` of a small ``LlamaForCausalLM`` (``config``: LlamaConfig keys over ``TINY_LLAMA``),
    with ``LoraConfig(r=r, target_modules=target_modules)``: every base weight frozen, A and B trainable (B zero)."""
    from peft import LoraConfig, get_peft_model

    base = causal_lm("llama", **{**TINY_LLAMA, **config})
    return get_peft_model(base, LoraConfig(r=r, target_modules=list(target_modules), task_type="CAUSAL_LM"))


def is_adapter(name: str) -> bool:
    """A LoRA parameter, by the name peft gives it (``...q_proj.lora_A.default.weight``)."""
    return ".lora_A." in name or ".lora_B." in name
