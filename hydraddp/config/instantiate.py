"""The one place hydraddp builds objects from ``_target_`` config nodes."""

from __future__ import annotations

from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate as hydra_instantiate
from omegaconf import DictConfig, OmegaConf

from hydraddp.models import HYDRADDP_MODEL_KEYS


def instantiate(node: Any, key: str, *args: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` whose error names the config key that failed (``key``)."""
    if isinstance(node, dict):
        node = OmegaConf.create(node)
    try:
        return hydra_instantiate(node, *args, **kwargs)
    except InstantiationException as exc:
        target = node.get("_target_") if isinstance(node, DictConfig) else None
        raise ValueError(f"{key}: could not build {target}: {exc}") from None


def model_kwargs(model_node: DictConfig) -> DictConfig:
    """The model node without hydraddp's own keys: what the model's constructor receives."""
    plain = OmegaConf.to_container(model_node, resolve=True)
    return OmegaConf.create({k: v for k, v in plain.items() if k not in HYDRADDP_MODEL_KEYS})
