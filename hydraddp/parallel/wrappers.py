"""The wrappers of the wraps other than fsdp2 (whose ``fully_shard`` step is ``parallelize.apply_fsdp2``): step 4 of
``parallelize``. Each takes the model (on its device, but under fsdp still on the meta device or the CPU) and the
``Layout``, and returns the wrapped model; the layout's ``wrapper_kwargs`` are the wrapper's own, as given.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch import nn

from hydraddp.parallel import meta_init, simulation
from hydraddp.parallel.layout import Layout
from hydraddp.parallel.precision import fsdp1_mixed_precision

T = TypeVar("T")

# Parameters that FSDP replaced while wrapping. An optimizer that still holds one of them was created
# before wrapping and would silently train nothing: auto_optim refuses it. Keyed by id with weak
# references, because tensors compare elementwise and so cannot live in a WeakSet.
_REPLACED_PARAMS: dict[int, weakref.ref] = {}


def remember_replaced(params: Iterable[torch.Tensor], wrapped: nn.Module) -> None:
    """Remember ``params`` (the model's before wrapping) that ``wrapped`` no longer holds. FSDP1 with
    ``use_orig_params=True`` keeps the original parameter objects (their storage becomes views of the flat
    parameter): an optimizer over them trains the wrapped model, and must not be refused."""
    kept = {id(p) for p in wrapped.parameters()}
    for p in params:
        if id(p) not in kept:
            _REPLACED_PARAMS[id(p)] = weakref.ref(p, lambda _, key=id(p): _REPLACED_PARAMS.pop(key, None))


def was_replaced(param: torch.Tensor) -> bool:
    ref = _REPLACED_PARAMS.get(id(param))
    return ref is not None and ref() is param

BATCHNORM_TYPES = (nn.modules.batchnorm._BatchNorm,)


def _enum(enum_cls: Any, value: Any) -> Any:
    """Accept FSDP1 enum members or their names in any case (config files hold strings)."""
    if value is None or isinstance(value, enum_cls):
        return value
    try:
        return enum_cls[str(value).upper()]
    except KeyError:
        valid = ", ".join(m.name.lower() for m in enum_cls)
        raise ValueError(f"{enum_cls.__name__}={value!r} is not an option; use one of: {valid}") from None


def apply_none(model: nn.Module, layout: Layout) -> nn.Module:
    return model


def apply_dp(model: nn.Module, layout: Layout) -> nn.Module:
    return nn.DataParallel(model, **layout.wrapper_kwargs)


def apply_ddp(model: nn.Module, layout: Layout) -> nn.Module:
    kwargs = dict(layout.wrapper_kwargs)
    if layout.device.type == "cuda":
        if "device_ids" in kwargs:
            raise ValueError(f"auto_model sets device_ids itself on CUDA (to [{layout.device.index}]); drop "
                             f"device_ids={kwargs['device_ids']}")
        kwargs["device_ids"] = [layout.device.index]
    if simulation.active():  # a plan: DDP's reducer needs real storage, its stand-in holds the same bytes
        return simulation.BucketedGradients(model, **kwargs)
    return nn.parallel.DistributedDataParallel(model, **kwargs)


def apply_fsdp(model: nn.Module, layout: Layout) -> nn.Module:
    """FSDP1's ``FullyShardedDataParallel``, its units from the layout's policy. A model built on the meta device is
    filled unit by unit as FSDP1 wraps it (``param_init_fn``)."""
    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    kwargs = {**layout.wrapper_kwargs, "auto_wrap_policy": layout.units}
    device = layout.device
    if "use_orig_params" not in kwargs and len({p.requires_grad for p in model.parameters()}) > 1:
        # FSDP1 flattens a unit into one parameter with one requires_grad: frozen weights beside trainable ones (a
        # LoRA model's base and adapters, in every attention block) fit in one unit only with the original
        # parameters kept. The WrapReport says it (use_orig_params).
        kwargs["use_orig_params"] = True
    # On CPU FSDP1 must be told device_id=cpu, or it looks for an accelerator.
    kwargs.setdefault("device_id", device)
    # Every rank starts from rank 0's weights, whatever each rank's seed or loaded checkpoint. FSDP1 does that
    # itself only for modules on a GPU; on the CPU the same broadcast happens here, before sharding.
    if device.type == "cuda" or kwargs.get("sync_module_states") is not None:
        kwargs.setdefault("sync_module_states", True)
    else:
        import torch.distributed as dist

        broadcast_module_states(model, kwargs.get("process_group") or dist.group.WORLD, device)
    replay = meta_init.replay_of(model)
    if replay is not None:  # built on the meta device: FSDP1 asks for each module's values as it wraps its unit
        kwargs.setdefault("param_init_fn", lambda module: replay.materialize_module(module, device))
    if layout.offload:
        kwargs.setdefault("cpu_offload", CPUOffload(offload_params=True))
    if kwargs.get("mixed_precision") is None:
        kwargs["mixed_precision"] = fsdp1_mixed_precision(layout.precision)
    for key, enum_cls in (("backward_prefetch", BackwardPrefetch), ("sharding_strategy", ShardingStrategy)):
        if key in kwargs:
            kwargs[key] = _enum(enum_cls, kwargs[key])
    return FSDP(model, **kwargs)


BROADCAST_BUCKET_BYTES = 64 * 1024 * 1024  # per coalesced broadcast (DDP's own module sync sends 250 MB at once)


def broadcast_module_states(model: nn.Module, group: Any, device: torch.device, src_in_group: int = 0) -> None:
    """Give every rank of ``group`` the parameters and buffers of its first rank, before sharding.

    FSDP2's ``fully_shard`` has no ``sync_module_states``: each rank keeps the shard of whatever it built, so
    ranks seeded with ``seed + rank`` (or loading pretrained weights on rank 0 only) would train a model
    that no rank ever held. The tensors go in coalesced broadcasts of up to ``BROADCAST_BUCKET_BYTES``
    (``_broadcast_coalesced``, as DDP's own sync), not one per tensor. Tensors the backend cannot send from where
    they are (CPU under nccl) travel through ``device``, a bucket at a time.
    """
    import torch.distributed as dist

    via_device = "nccl" in str(dist.get_backend(group))  # nccl, or nccl with a gloo side (CPU tensors are faster so)
    # Not materialized yet (meta), or already sharded by the caller (DTensor): nothing to send.
    tensors = [t for t in [*model.parameters(), *model.buffers()]
               if not t.is_meta and not isinstance(t, torch.distributed.tensor.DTensor)]
    with torch.no_grad():
        for bucket in size_buckets(tensors, lambda t: t.numel() * t.element_size(), BROADCAST_BUCKET_BYTES):
            sent = [t.detach().to(device) if via_device and t.device != device else t.detach() for t in bucket]
            # The source is the group's own rank (as DDP's module sync passes it), not a global one.
            dist._broadcast_coalesced(group, sent, BROADCAST_BUCKET_BYTES, src_in_group)
            for tensor, arrived in zip(bucket, sent):
                if arrived.device != tensor.device:
                    tensor.copy_(arrived)


def size_buckets(items: list[T], nbytes: Callable[[T], int], max_bytes: int) -> list[list[T]]:
    """``items`` in order, in groups of at most ``max_bytes`` (an item larger than that alone)."""
    buckets: list[list[T]] = [[]]
    size = 0
    for item in items:
        if buckets[-1] and size + nbytes(item) > max_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(item)
        size += nbytes(item)
    return [bucket for bucket in buckets if bucket]


def convert_batchnorm(model: nn.Module, factory: Any) -> nn.Module:
    """Replace every BatchNorm with ``factory(bn)``, keeping its parameters and statistics."""
    if isinstance(model, BATCHNORM_TYPES):
        new = factory(model)
        new.load_state_dict(model.state_dict())
        return new
    for name, child in model.named_children():
        setattr(model, name, convert_batchnorm(child, factory))
    return model


def apply_horovod(model: nn.Module, layout: Layout) -> nn.Module:
    """Horovod's data parallelism: every rank starts from rank 0's parameters and buffers."""
    import horovod.torch as hvd

    if layout.sync_bn:
        model = convert_batchnorm(
            model,
            lambda bn: hvd.SyncBatchNorm(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats).to(
                next(bn.parameters(), torch.empty(0)).device
            ),
        )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model
