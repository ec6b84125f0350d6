"""build_model(cfg): the model of a composed config, wrapped as its wrap/precision/offload say."""

from __future__ import annotations

import logging
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

import hydraddp.distributed as idist
from hydraddp.distributed import simulated
from hydraddp.parallel import meta_init
from hydraddp.parallel.mesh import MeshShape
from hydraddp.parallel.policies import declared_blocks
from hydraddp.distributed.report import WrapReport
from hydraddp.models.of_config import model_factory

POLICY_KEYS = ("auto_wrap_policy", "block_classes", "min_num_params")
log = logging.getLogger(__name__)


def wrap_kwargs(cfg: DictConfig, model: nn.Module) -> dict[str, Any]:
    """The wrapper's keyword arguments: ``wrap.kwargs``, the model's own FSDP blocks, the offload."""
    kwargs = dict(cfg.wrap.kwargs)
    if cfg.wrap.name in ("fsdp", "fsdp2"):
        # What one unit is, the model says itself (policies.declared_blocks); the user's policy keys win.
        blocks = declared_blocks(model)
        if blocks and not any(key in kwargs for key in POLICY_KEYS):
            kwargs["block_classes"] = list(blocks)  # what to shard is the model's to say
        if cfg.offload.name != "none":
            kwargs["offload"] = cfg.offload.name
    if cfg.wrap.name == "fsdp" and cfg.optim.get("no_decay_norm_and_bias"):
        kwargs.setdefault("use_orig_params", True)  # parameter groups need FSDP1's original parameters
    return kwargs


SHARDING_WRAPS = ("fsdp", "fsdp2")


def pipeline_stages(cfg: DictConfig) -> int:
    """``mesh.pp``: the places of a pipeline's stages (1: no pipeline; a config without a mesh has none)."""
    return int(OmegaConf.select(cfg, "mesh.pp", default=1))


def data_mesh(cfg: DictConfig) -> MeshShape | None:
    """The mesh whose data-parallel ranks split the data (``train.data.readers``): fsdp2's, whose TP groups each read
    one share of a batch, and a pipelined one's, whose pipelines do; None (every rank its own share) otherwise."""
    if cfg.wrap.name == "fsdp2" or pipeline_stages(cfg) > 1:
        return MeshShape.of(cfg.mesh).resolved(idist.get_world_size())
    return None


def tp_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """``tp_plan=wrap.tp_plan`` when the config gives one (else the model's own plan is used)."""
    plan = cfg.wrap.get("tp_plan")
    return {"tp_plan": dict(plan)} if plan else {}


def build_path(cfg: DictConfig, model: nn.Module | None = None) -> str:
    """How ``instantiate_model`` builds ``cfg.model``: ``meta`` (on the meta device, filled after sharding) or
    ``whole``. With ``model`` (built whole, or with fake tensors by the plan), a model whose weights are tied, which
    is never replayed, counts as whole."""
    init_device = cfg.model.get("init_device", "auto")
    if init_device == "cpu" or (init_device == "auto" and cfg.wrap.name not in SHARDING_WRAPS):
        return "whole"
    if model is not None and init_device == "auto" and meta_init.shared_tensors(model):
        return "whole"
    return "meta"


def instantiate_model(cfg: DictConfig) -> nn.Module:
    """``cfg.model``, built under ``trainer.seed`` (every rank builds the same weights; the wrappers broadcast rank 0's
    anyway).

    ``model.init_device``: ``meta`` builds it on the meta device, and ``auto_model`` fills each rank's shards after
    sharding, module by module, with the values the whole build has (``meta_init``); ``cpu`` builds it whole; ``auto``
    is ``meta`` under fsdp and fsdp2 and ``cpu`` otherwise, and a model whose initialization cannot be replayed is then
    built whole, with a warning saying why (under ``meta`` that is an error).
    """
    torch.manual_seed(cfg.trainer.seed)
    factory = model_factory(cfg.model)
    init_device = cfg.model.get("init_device", "auto")
    if build_path(cfg) == "whole" or simulated.active():
        return factory()  # a plan's fake tensors stand for either build (the plan counts the build: build_path)
    start = torch.get_rng_state()
    try:
        return meta_init.build_on_meta(factory)[0]
    except meta_init.NotReplayable as exc:
        if init_device == "meta":
            raise ValueError(f"model.init_device=meta: {exc}. Set model.init_device=cpu to build it whole.") from None
        log.warning("model.init_device=auto: building the model whole on every rank: %s", exc)
        torch.set_rng_state(start)
        return factory()


def wrap_model(cfg: DictConfig, model: nn.Module) -> tuple[nn.Module, WrapReport]:
    """``auto_model`` with the config's wrap, precision and offload."""
    wrapped = idist.auto_model(model, sync_bn=bool(cfg.model.get("sync_bn", False)), wrap=cfg.wrap.name,
                               precision=cfg.precision.name,
                               activation_checkpointing=cfg.trainer.activation_checkpointing,
                               compile=cfg.trainer.compile, mesh_shape=dict(cfg.mesh),
                               **tp_kwargs(cfg), **wrap_kwargs(cfg, model))
    return wrapped, idist.wrap_report(wrapped)


def build_model(cfg: DictConfig) -> tuple[nn.Module, WrapReport]:
    """Instantiate ``cfg.model`` and hand it to ``auto_model`` with the config's wrap, precision and offload.

    Call it on every rank, inside a distributed context (``idist.Parallel``) or in one process. Every rank
    starts from rank 0's weights: DDP, Horovod and both FSDPs broadcast them.

    >>> cfg = hydraddp.config.compose.compose(["wrap=fsdp2"])            # doctest: +SKIP
    >>> model, report = build_model(cfg); print(report.units)         # doctest: +SKIP
    """
    return wrap_model(cfg, instantiate_model(cfg))


def flops_per_token(model: nn.Module) -> float | None:
    """The model's own ``flops_per_token()``, for MFU. Ask the model before wrapping: FSDP1 flattens and
    shards the parameters, and a count taken after it sees only this rank's shard."""
    fn = getattr(model, "flops_per_token", None)
    return fn() if callable(fn) else None
