"""One training step: the micro-batches' forward and backward passes (gradients reduced once, with the last), then
unscaling, clipping and the optimizer step, in the order each wrapper needs them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hydraddp.train import tasks


def clip(model: nn.Module, max_norm: float) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):
        model.clip_grad_norm_(max_norm)  # FSDP1's flat shards need its own norm across ranks
        return
    params = [p for p in model.parameters() if p.grad is not None]
    if len({getattr(p, "device_mesh", None) for p in params}) <= 1:
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # DTensor-aware for FSDP2
        return
    clip_by(params, max_norm, grad_norm(params))


def grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """The norm of ``params``' gradients, whole (a plain tensor). Under tensor parallel, what TP split lives on the
    (dp, tp) mesh and the rest on dp alone, and torch's norm cannot mix meshes in one op: each mesh's norm is made
    whole, and they add up as squares."""
    norms = [nn.utils.get_total_norm([p.grad for p in group]) for group in _by_mesh(params)]
    if not norms:
        return torch.zeros(())
    return torch.stack([getattr(norm, "full_tensor", lambda n=norm: n)() for norm in norms]).norm()


def clip_by(params: list[nn.Parameter], max_norm: float, total: torch.Tensor) -> None:
    """Scale ``params``' gradients so that their norm, ``total``, is at most ``max_norm`` (a mesh at a time, as one
    op cannot mix them)."""
    from torch.distributed.tensor.experimental import implicit_replication

    with implicit_replication():  # the plain total against each mesh's DTensors
        for group in _by_mesh(params):
            nn.utils.clip_grads_with_norm_(group, max_norm, total)


def _by_mesh(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """``params`` by the mesh they live on (plain tensors together)."""
    groups: dict[Any, list[nn.Parameter]] = {}
    for param in params:
        groups.setdefault(getattr(param, "device_mesh", None), []).append(param)
    return list(groups.values())


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler, grad_clip: float | None,
                   horovod: bool) -> None:
    """Unscale (fp16), clip, step and update the scaler.

    Horovod reduces the gradients inside ``step()``, asynchronously since the backward pass. Unscaling or
    clipping must see the reduced gradients, so they wait for the reductions first (``synchronize``) and the
    step then must not reduce them a second time (``skip_synchronize``), as Horovod documents.
    """
    touches_grads = scaler is not None or bool(grad_clip)
    reduced_first = horovod and touches_grads
    if reduced_first:
        optimizer.synchronize()
    if grad_clip:
        if scaler is not None:
            scaler.unscale_(optimizer)
        clip(model, grad_clip)
    elif scaler is not None and reduced_first:
        scaler.unscale_(optimizer)  # here, not inside scaler.step(): the reductions are over by now
    with optimizer.skip_synchronize() if reduced_first else contextlib.nullcontext():
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Reduce gradients over the ranks in this backward pass (``enabled``), or keep them on this rank for a
    micro-batch that is not the step's last: DDP's and FSDP1's ``no_sync``, FSDP2's ``set_requires_gradient_sync``.
    (Horovod counts its backward passes itself: ``backward_passes_per_step``.)"""
    from torch.distributed.fsdp import FSDPModule

    if enabled:
        yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif callable(getattr(model, "no_sync", None)):
        with model.no_sync():
            yield
    else:
        yield


def train_step(model: nn.Module, task: Any, batch: Any, optimizer: torch.optim.Optimizer, scaler,
               grad_clip: float | None, horovod: bool, accumulate: int = 1) -> torch.Tensor:
    """One optimizer step on this rank's ``batch``, in ``accumulate`` micro-batches of equal size. Each micro-batch's
    loss counts by its share of the batch (``tasks.loss_weight``: samples, or the tokens that count), so the step
    equals one pass over the whole batch; gradients cross the ranks once, in the last micro-batch's backward pass.
    Returns the batch's loss (detached)."""
    optimizer.zero_grad()  # set_to_none by default (under Horovod too: comp_models.horovod.accept_set_to_none)
    total = torch.zeros((), device=next(tasks.tensors(batch)).device)
    micro_batches = tasks.split(batch, accumulate)
    weights = [tasks.loss_weight(task, micro) for micro in micro_batches] if accumulate > 1 else [1]
    whole = max(sum(weights), 1)
    for index, (micro, weight) in enumerate(zip(micro_batches, weights)):
        with gradient_sync(model, enabled=index == len(micro_batches) - 1):
            loss = task.loss(model, micro) * (weight / whole)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        total += loss.detach().float()
    optimizer_step(model, optimizer, scaler, grad_clip, horovod)
    return total
