"""build_model(cfg): the model of a composed config, wrapped as its wrap/precision/offload say."""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

import hydraddp.distributed as idist
from hydraddp.config.instantiate import instantiate, model_kwargs
from hydraddp.distributed.report import WrapReport

POLICY_KEYS = ("auto_wrap_policy", "block_classes", "min_num_params")


def wrap_kwargs(cfg: DictConfig, model: nn.Module) -> dict[str, Any]:
    """The wrapper's keyword arguments: ``wrap.kwargs``, the model's own FSDP blocks, the offload."""
    kwargs = dict(cfg.wrap.kwargs)
    if cfg.wrap.name in ("fsdp", "fsdp2"):
        blocks = getattr(model, "fsdp_block_classes", ())
        if blocks and not any(key in kwargs for key in POLICY_KEYS):
            kwargs["block_classes"] = list(blocks)  # what to shard is the model's to say
        if cfg.offload.name != "none":
            kwargs["offload"] = cfg.offload.name
    return kwargs


def build_model(cfg: DictConfig) -> tuple[nn.Module, WrapReport]:
    """Instantiate ``cfg.model`` and hand it to ``auto_model`` with the config's wrap, precision and offload.

    Call it on every rank, inside a distributed context (``idist.Parallel``) or in one process. The seed
    is ``trainer.seed`` on every rank: FSDP does not broadcast the initial weights, so they must agree.

    >>> cfg = hydraddp.config.compose.compose(["wrap=fsdp2"])            # doctest: +SKIP
    >>> model, report = build_model(cfg); print(report.units)         # doctest: +SKIP
    """
    torch.manual_seed(cfg.trainer.seed)
    model = instantiate(model_kwargs(cfg.model), "model")
    wrapped = idist.auto_model(model, sync_bn=bool(cfg.model.get("sync_bn", False)), wrap=cfg.wrap.name,
                               precision=cfg.precision.name, **wrap_kwargs(cfg, model))
    return wrapped, idist.wrap_report(wrapped)
