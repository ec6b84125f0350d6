"""The model of a config: the one way hydraddp builds "the model this config runs".

The workers' build (``hydraddp.build``), the checks before a launch (a resume's checkpoint, ``model.pretrained``, the
TP plan, the meta-device replay), the plan, ``python -m hydraddp.export`` and the model a run's LoggedModel loads all
build it here, so they agree on what it is: a pretrained Hugging Face directory gives its ``config.json`` (the
architecture), and a checkpoint's recorded transformers config (``hf_config``) gives exactly the model it was saved
from, whether or not that directory is still there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from hydraddp.config.instantiate import instantiate, model_kwargs
from hydraddp.models.hf import HF_TARGET, causal_lm, is_model_directory


def model_factory(model_cfg: DictConfig | Mapping[str, Any],
                  saved_hf_config: Mapping[str, Any] | None = None) -> Callable[[], nn.Module]:
    """What builds ``model_cfg``'s model: its ``_target_`` with its arguments, plus, for a transformers model, the
    config a checkpoint recorded (``saved_hf_config``) or else the ``config.json`` of ``model.pretrained``."""
    if not isinstance(model_cfg, DictConfig):
        model_cfg = OmegaConf.create(dict(model_cfg))
    node = model_kwargs(model_cfg)
    if node.get("_target_") == HF_TARGET:
        if saved_hf_config is not None:
            saved, attention = dict(saved_hf_config), node.get("attn_implementation", "sdpa")
            return lambda: causal_lm(attn_implementation=attention, saved_config=saved)
        if is_model_directory(model_cfg.get("pretrained")):
            node.config_dir = str(model_cfg.pretrained)
    return lambda: instantiate(node, "model")


def model_of(model_cfg: DictConfig | Mapping[str, Any], device: torch.device | str = "meta",
             saved_hf_config: Mapping[str, Any] | None = None) -> nn.Module:
    """``model_cfg``'s model, built on ``device``: ``meta`` (the default) gives its structure and shapes without
    memory, for checks; ``cpu`` gives its initial weights."""
    with torch.device(device):
        return model_factory(model_cfg, saved_hf_config)()


def recorded_model(meta: Mapping[str, Any], device: torch.device | str = "meta") -> nn.Module:
    """The model a checkpoint was saved from, from its metadata (``read_meta``): its config's model node and the
    transformers config it recorded."""
    return model_of(meta["config"]["model"], device, meta.get("hf_config"))
