"""Hugging Face transformers models built from their config class: random weights, nothing downloaded.

``model=hf_causal_lm`` builds, e.g., a small Llama. Its ``_no_split_modules`` (``LlamaDecoderLayer``) gives FSDP one
unit per decoder layer (``policies.declared_blocks``); its output's ``.loss`` is what ``task=causal_lm`` uses.

A model directory (``model.pretrained``) gives the architecture through its ``config.json``: ``from_hf_config`` makes the
model node say so (the run's parameters then say what was trained), and a checkpoint keeps the whole config
(``config_dict``), which ``causal_lm(saved_config=...)`` builds again when the directory is gone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from hydraddp.models import HYDRADDP_MODEL_KEYS
from hydraddp.parallel.pipeline import PipelineShape

HF_CONFIG = "config.json"
HF_TARGET = "hydraddp.models.hf.causal_lm"
# Keys of hydraddp's hf_causal_lm node that are not the transformers config's own attributes.
HF_NODE_KEYS = ("_target_", "architecture", "attn_implementation")


class PretrainedError(ValueError):
    """``model.pretrained`` cannot start this model: the message names the path, the keys and the fix."""


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(f"model=hf_causal_lm needs Hugging Face transformers ({exc}): "
                          "pip install 'hydraddp[models]'") from None
    return transformers


def causal_lm(architecture: str = "llama", attn_implementation: str = "sdpa", config_dir: str | None = None,
              saved_config: dict[str, Any] | None = None, **config: Any) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` of ``architecture`` (a transformers ``model_type``: llama, gpt2, qwen2,
    mistral, ...) with ``config`` as its config class's keywords (sizes, vocabulary). With ``config_dir`` (a model
    directory, ``model.pretrained``), its ``config.json`` with ``config`` on top: the architecture, not the weights
    (``hydraddp.train.pretrained`` loads those into the shards). With ``saved_config`` (a checkpoint's ``hf_config``),
    exactly the config the checkpoint's model was built with."""
    transformers = _transformers()
    try:
        if saved_config is not None:
            model_config = config_from_dict(saved_config)
        elif config_dir is not None:
            model_config = pretrained_config(config_dir, **config)
        else:
            model_config = transformers.AutoConfig.for_model(architecture, **config)
    except ValueError as exc:
        raise ValueError(f"model.architecture={architecture!r}: {exc}") from None
    # fp32 master weights whatever dtype a pretrained config.json names: precision= decides what computes in what.
    model = transformers.AutoModelForCausalLM.from_config(model_config, attn_implementation=attn_implementation,
                                                          dtype=torch.float32)
    if _is_decoder(model):
        model.pipeline_shape = DECODER_PIPELINE
    return model


def _is_decoder(model: nn.Module) -> bool:
    """A decoder as Llama's (Qwen2, Mistral, ... too): ``model.embed_tokens``, ``model.layers``, ``model.norm`` and
    ``model.rotary_emb``, then ``lm_head``, each layer called with the rotary embedding and the causal mask."""
    inner = getattr(model, "model", None)
    return all(isinstance(getattr(inner, name, None), nn.Module)
               for name in ("embed_tokens", "layers", "norm", "rotary_emb")) and \
        isinstance(getattr(model, "lm_head", None), nn.Module) and isinstance(inner.layers, nn.ModuleList)


def decoder_stage_forward(stage: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A pipeline stage of a Llama-style decoder: the token ids (first stage) or hidden states in, through the
    stage's layers, with the rotary embedding and the causal mask that the decoder's own forward makes; the logits
    (last stage) or hidden states out. What ``LlamaModel.forward`` does, without the cache."""
    from transformers.masking_utils import create_causal_mask

    inner = stage.model
    hidden = inner.embed_tokens(x) if inner.embed_tokens is not None else x
    positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    mask = create_causal_mask(config=inner.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                              position_ids=positions)
    rotary = inner.rotary_emb(hidden, position_ids=positions)
    for layer in inner.layers.children():  # this stage's (the others are None)
        hidden = layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
    return stage.lm_head(inner.norm(hidden)) if stage.lm_head is not None else hidden


# Where pipeline parallel cuts such a decoder (hydraddp.parallel.pipeline): the state dict's own names, so that
# pretrained weights and checkpoints load into the stages by name.
DECODER_PIPELINE = PipelineShape(blocks="model.layers", first=("model.embed_tokens",),
                                 last=("model.norm", "lm_head"), stage_forward=decoder_stage_forward)


def pretrained_config(path: Any, **config: Any) -> Any:
    """The transformers config of a model directory, read from its ``config.json`` alone (nothing downloaded)."""
    return _transformers().AutoConfig.from_pretrained(str(path), local_files_only=True, **config)


def config_from_dict(saved: dict[str, Any]) -> Any:
    """A transformers config from its ``to_dict()`` (what a checkpoint keeps as ``hf_config``)."""
    return _transformers().CONFIG_MAPPING[saved["model_type"]].from_dict(dict(saved))


def config_dict(model: nn.Module) -> dict[str, Any] | None:
    """The config of the outermost transformers model inside ``model`` (through any wrapper), as a dict; None for a
    model that holds none."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if callable(getattr(config, "to_dict", None)) and hasattr(config, "model_type"):
            return config.to_dict()
    return None


def is_model_directory(path: Any) -> bool:
    return path is not None and Path(path, HF_CONFIG).is_file()


def typed_model_keys(overrides: list[str]) -> dict[str, str]:
    """``model.KEY=VALUE`` overrides typed on the command line: KEY -> VALUE as typed."""
    typed = {}
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key.startswith("model.") and key.count(".") == 1:
            typed[key.removeprefix("model.")] = value
    return typed


def from_hf_config(model_node: Any, path: Path, typed: dict[str, str]) -> None:
    """Make ``model_node`` (an hf_causal_lm node, edited in place) describe the model of ``path/config.json``: its
    ``architecture`` and every size key the config has, so that the run's parameters say what was trained. A key
    typed on the command line that contradicts the config is a ``PretrainedError`` naming both values; one the config
    does not have is passed on, as ``from_pretrained`` would; the node's defaults that the config lacks are dropped.
    Running it again on the node it made changes nothing."""
    config = pretrained_config(path)
    node_keys = [k for k in model_node if k not in HF_NODE_KEYS and k not in HYDRADDP_MODEL_KEYS]
    wanted = {"architecture": config.model_type,
              **{k: getattr(config, k) for k in node_keys if hasattr(config, k)}}
    for key, value in wanted.items():
        if key in typed and _differs(model_node[key], value):
            raise PretrainedError(
                f"model.{key}={typed[key]} contradicts model.pretrained={path}: its {HF_CONFIG} has "
                f"{'model_type' if key == 'architecture' else key}={value}. Drop model.{key} (the pretrained "
                "model's config is the architecture), or start from other weights.")
        model_node[key] = value
    for key in node_keys:
        if not hasattr(config, key) and key not in typed:
            del model_node[key]


def _differs(given: Any, value: Any) -> bool:
    if isinstance(value, (list, tuple)) or isinstance(given, (list, tuple)):
        return list(given) != list(value)
    return given != value
