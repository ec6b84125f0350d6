"""One optimizer step after the backward pass: unscaling, clipping and the step, in the order each
wrapper needs them."""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def clip(model: nn.Module, max_norm: float) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):
        model.clip_grad_norm_(max_norm)  # FSDP1's flat shards need its own norm across ranks
    else:
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # DTensor-aware for FSDP2


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
