"""ignite's auto_model / auto_optim / auto_dataloader, plus explicit wrap modes and precision."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset, DistributedSampler, IterableDataset, Sampler

from hydraddp.distributed import utils

from hydraddp.parallel import machine, meta_init, wrappers
from hydraddp.parallel.combinations import Combination, ConfigurationError, Problem, resolve_wrap
from hydraddp.distributed.comp_models.horovod import HOROVOD, accept_set_to_none
from hydraddp.parallel.mesh import MeshShape
from hydraddp.parallel.layout import Layout
from hydraddp.parallel.parallelize import parallelize
from hydraddp.parallel.precision import make_grad_scaler, precision_spec
from hydraddp.distributed.report import WrapRecord

log = logging.getLogger(__name__)


def _offload_from(kwargs: dict[str, Any]) -> str:
    """``offload="cpu"`` (hydraddp's name) or the wrappers' own offload objects both count."""
    offload = kwargs.pop("offload", None) or "none"
    cpu_offload = kwargs.get("cpu_offload")
    if getattr(cpu_offload, "offload_params", False) or type(kwargs.get("offload_policy")).__name__ == "CPUOffloadPolicy":
        offload = "cpu"
    return offload


def combination_here(**fields: Any) -> Combination:
    """A ``Combination`` for this process: its context's backend and world size, this machine's devices."""
    ctx = utils.current()
    fields.setdefault("backend", ctx.backend())
    fields.setdefault("world_size", ctx.get_world_size())
    # In a worker, which uses CUDA anyway, torch's own count (the launcher counts without touching the driver).
    fields.setdefault("cuda_device_count", torch.cuda.device_count() if torch.cuda.is_available() else 0)
    return machine.combination(has_horovod=ctx.backend() == HOROVOD, **fields)


def auto_model(
    model: nn.Module,
    sync_bn: bool = False,
    use_fsdp: bool = False,
    *,
    wrap: str | None = None,
    precision: str | None = None,
    activation_checkpointing: bool = False,
    compile: bool = False,
    **kwargs: Any,
) -> nn.Module:
    """Move ``model`` to ``device()`` and wrap it for the current context.

    ``wrap=None``/``"auto"`` is ignite's rule: DDP when world size > 1 on a native backend, the Horovod
    broadcast under horovod, DataParallel with no process group and several GPUs, else unwrapped.
    ``use_fsdp=True`` means ``wrap="fsdp2"``. Explicit ``wrap`` is ``none|dp|ddp|fsdp|fsdp2``; ``kwargs``
    go to the wrapper, plus ``auto_wrap_policy``/``block_classes``/``min_num_params`` for FSDP and
    ``offload="cpu"``. ``precision`` is ``fp32|bf16|fp16|bf16-true``. ``activation_checkpointing=True`` recomputes
    each block's activations in the backward pass (blocks: ``block_classes`` or the model's own declaration).
    ``compile=True`` is ``torch.compile``: each block before ``fully_shard`` under fsdp2 (the whole model when it
    declares no blocks), the whole model under none and ddp; other wraps refuse it. ``mesh_shape=(dp_replicate,
    dp_shard, tp)`` (or a ``MeshShape``; ``dp_shard=-1``: the ranks left) makes fsdp2 HSDP on a 2-D mesh; without it,
    fsdp2 shards over every rank, as ignite's.

    >>> model = idist.auto_model(model, wrap="fsdp2", precision="bf16", block_classes=["Block"])  # doctest: +SKIP
    """
    wrap = _wrap_asked(wrap, use_fsdp)
    offload = _offload_from(kwargs)
    combo = combination_here(wrap=wrap or "auto", precision=precision or "fp32", offload=offload, sync_bn=sync_bn,
                             compile=compile, nproc_per_node=utils.get_nproc_per_node())
    machine.raise_for_problems(combo)
    layout = Layout.of(model, resolve_wrap(combo), precision_spec(precision), utils.device(),
                           utils.get_world_size(), offload=offload == "cpu", sync_bn=sync_bn,
                           activation_checkpointing=activation_checkpointing, compile=compile, **kwargs)
    log.info("auto_model: wrap=%s precision=%s offload=%s on %s", layout.wrap, layout.precision.name, offload, layout.device)
    init_device = "meta" if meta_init.replay_of(model) is not None else \
        str(next(model.parameters(), torch.empty(0)).device.type)
    total_numel = sum(p.numel() for p in model.parameters())
    trainable_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if trainable_numel < total_numel:
        log.info("auto_model: %d of %d parameters train; the rest are frozen (no gradients, no optimizer state)",
                 trainable_numel, total_numel)
    model, checkpointed, compiled = parallelize(model, layout)
    model._hydraddp_wrap = WrapRecord(layout.wrap, layout.precision, offload, total_numel, tuple(checkpointed),
                                       tuple(compiled), init_device, layout.mesh, trainable_numel)
    return model


def _wrap_asked(wrap: str | None, use_fsdp: bool) -> str | None:
    """``use_fsdp=True`` (the seed's spelling) means ``wrap="fsdp2"``."""
    if not use_fsdp:
        return wrap
    if wrap not in (None, "auto", "fsdp2"):
        raise ValueError(f"use_fsdp=True means wrap='fsdp2', but wrap={wrap!r} was given; pass one of them")
    return "fsdp2"


def auto_optim(optimizer: torch.optim.Optimizer, **kwargs: Any) -> torch.optim.Optimizer:
    """ignite's ``auto_optim``: Horovod's ``DistributedOptimizer`` under horovod, else the optimizer itself.

    Refuses an optimizer created before FSDP wrapping: it holds parameters FSDP replaced. Under horovod,
    ``model=`` supplies ``named_parameters``; ``compression="fp16"|"none"``, ``backward_passes_per_step``
    and ``op`` pass through.
    """
    stale = sum(1 for g in optimizer.param_groups for p in g["params"] if wrappers.was_replaced(p))
    if stale:
        raise ConfigurationError(
            Problem(
                ("optimizer",),
                f"The optimizer holds {stale} parameter(s) of the model as it was before auto_model wrapped it "
                "with FSDP, which replaced them; stepping it would not train the wrapped model.",
                "Create the optimizer after wrapping: model = idist.auto_model(model, wrap=...); "
                "optimizer = torch.optim.SGD(model.parameters(), ...).",
            )
        )
    model = kwargs.pop("model", None)
    if utils.backend() != HOROVOD:
        return optimizer
    import horovod.torch as hvd

    if model is not None:
        kwargs.setdefault("named_parameters", model.named_parameters())
    compression = kwargs.pop("compression", None)
    if isinstance(compression, str):
        kwargs["compression"] = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[compression]
    elif compression is not None:
        kwargs["compression"] = compression
    state = optimizer.state_dict()
    optimizer = accept_set_to_none(hvd.DistributedOptimizer(optimizer, **kwargs))
    if state["state"]:
        optimizer.load_state_dict(state)  # Horovod's wrapper is a new optimizer: it would start from nothing
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    # A fresh optimizer has no state to broadcast, and Horovod would "initialize" it with a step on zero
    # gradients: harmless for SGD, but AdamW then decays every weight and counts one step too many.
    return optimizer


def grad_scaler(model: nn.Module, **kwargs: Any):
    """The grad scaler ``model``'s precision needs: ``ShardedGradScaler`` under FSDP, ``GradScaler`` otherwise,
    None for precisions without one (use ``scaler is None`` to skip scaling). ``kwargs`` go to the scaler."""
    record: WrapRecord | None = getattr(model, "_hydraddp_wrap", None)
    if record is None:
        return None
    return make_grad_scaler(record.precision, sharded=record.wrap in ("fsdp", "fsdp2"),
                            device_type=utils.device().type, **kwargs)


class DistributedProxySampler(DistributedSampler):
    """ignite's ``DistributedProxySampler``: this rank's share of another sampler's indices.

    The wrapped sampler is iterated as many times as the padded total size needs, under
    ``torch.manual_seed(epoch)`` (so a random sampler draws the same order on every rank), then every
    ``num_replicas``-th index from ``rank`` is kept. The wrapped sampler must have a constant length.
    """

    def __init__(self, sampler: Sampler, num_replicas: int | None = None, rank: int | None = None) -> None:
        if not isinstance(sampler, Sampler):
            raise TypeError(f"Argument sampler should be instance of torch Sampler, but given: {type(sampler)}")
        if isinstance(sampler, DistributedSampler):
            raise TypeError("Argument sampler must not be a distributed sampler already")
        if not hasattr(sampler, "__len__"):
            raise TypeError("Argument sampler should have length")
        super().__init__(sampler, num_replicas=num_replicas, rank=rank, shuffle=False)  # type: ignore[arg-type]
        self.sampler = sampler

    def __iter__(self) -> Iterator[int]:
        torch.manual_seed(self.epoch)  # as ignite: every rank draws the same order from a random sampler
        indices: list[int] = []
        while len(indices) < self.total_size:
            indices += list(self.sampler)
        indices = indices[: self.total_size][self.rank : self.total_size : self.num_replicas]
        if len(indices) != self.num_samples:
            raise RuntimeError(f"{len(indices)} vs {self.num_samples}")
        return iter(indices)


def auto_dataloader(dataset: Dataset, **kwargs: Any) -> TorchDataLoader:
    """ignite's ``auto_dataloader``, with ignite's rules:

    - ``batch_size`` is divided by the world size when it is at least the world size (floored), else kept;
    - ``num_workers`` is divided by the processes of this node, rounded up, when at least that many;
    - no sampler: a ``DistributedSampler`` (``shuffle`` goes to it); a ``DistributedSampler`` is kept as it is
      (with a warning if its rank or ``num_replicas`` disagree with this process); any other sampler is
      wrapped by ``DistributedProxySampler``; a ``batch_sampler`` is used as given, with a warning;
    - ``pin_memory`` defaults to True on CUDA.

    hydraddp adds two keywords: ``seed``, the seed of the ``DistributedSampler`` it creates (default 0), and
    ``mesh_shape``, auto_model's: with tensor parallel the data is split over the data-parallel ranks (the world over
    ``tp``), each TP group reading one share.
    Call ``loader.sampler.set_epoch(epoch)`` before each epoch for a new order, as with ignite.
    """
    rank, world = utils.get_rank(), utils.get_world_size()
    seed = kwargs.pop("seed", 0)
    mesh_shape = kwargs.pop("mesh_shape", None)
    if mesh_shape is not None:
        shape = MeshShape.of(mesh_shape).resolved(world)
        rank, world = shape.data_parallel_rank(rank), shape.dp
    # Several processes read: each its share, in one order (TP alone too: its ranks must read the same batches).
    if utils.get_world_size() > 1:
        if "batch_size" in kwargs and kwargs["batch_size"] >= world:
            kwargs["batch_size"] //= world
        nproc = utils.get_nproc_per_node()
        if "num_workers" in kwargs and kwargs["num_workers"] >= nproc:
            kwargs["num_workers"] = (kwargs["num_workers"] + nproc - 1) // nproc
        if "batch_sampler" in kwargs:
            warnings.warn("Found batch_sampler in provided kwargs. Please, make sure that it is compatible "
                          "with distributed configuration")
        elif isinstance(dataset, IterableDataset):
            log.info("Found iterable dataset, dataloader will be created without any distributed sampling. "
                     "Please, make sure that the dataset itself produces different data on different ranks.")
        else:
            sampler = kwargs.get("sampler")
            if isinstance(sampler, DistributedSampler):  # sharded already: never sharded again
                if sampler.rank != rank:
                    warnings.warn(f"Found distributed sampler with rank={sampler.rank}, but process rank is {rank}")
                if sampler.num_replicas != world:
                    warnings.warn(f"Found distributed sampler with num_replicas={sampler.num_replicas}, "
                                  f"but world size is {world}")
            elif sampler is None:
                shuffle = kwargs.pop("shuffle", True)
                sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
            else:
                sampler = DistributedProxySampler(sampler, num_replicas=world, rank=rank)
            kwargs["sampler"] = sampler
    kwargs["pin_memory"] = kwargs.get("pin_memory", "cuda" in utils.device().type)
    return TorchDataLoader(dataset, **kwargs)
