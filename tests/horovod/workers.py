"""Worker functions for the Horovod tests (run on every rank as fn(local_rank, ...))."""

from __future__ import annotations

import os

import torch

import hydraddp.distributed as idist
from hydraddp.distributed.elastic import HOROVOD_RUN_MISSETS
from tests.distributed.workers import full_params


def broadcast_from_rank0(local_rank: int) -> dict:
    """Each rank starts from its own random init; auto_model must leave rank 0's everywhere."""
    torch.manual_seed(100 + idist.get_rank())
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = idist.auto_model(model)
    return {"before": before, "after": full_params(wrapped), "wrapper": idist.wrap_report(wrapped).wrapper,
            "type": type(wrapped).__name__}


def optimizer_state_from_rank0(local_rank: int) -> dict:
    """Optimizer state that differs per rank before auto_optim is rank 0's on every rank after it."""
    torch.manual_seed(0)
    model = idist.auto_model(torch.nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # One local step on rank-specific data fills each rank's momentum buffers differently.
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(idist.get_rank()))
    model(x).sum().backward()
    optimizer.step()
    before = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    optimizer = idist.auto_optim(optimizer, model=model, compression="fp16", backward_passes_per_step=1)
    after = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    # Horovod builds the wrapper as a subclass named like the optimizer; its methods give it away.
    return {"before": before, "after": after, "distributed": hasattr(optimizer, "synchronize")}


def collectives(local_rank: int) -> dict:
    rank = idist.get_rank()
    return {"rank": rank, "world": idist.get_world_size(), "backend": idist.backend(),
            "sum": idist.all_reduce(rank + 1), "avg": idist.all_reduce(torch.tensor([float(rank)]), "average").tolist(),
            "gather": idist.all_gather({"r": rank}), "broadcast": idist.broadcast(f"from{rank}", src=0),
            # only the source has a value: Horovod must not name the collective after each rank's type
            "safe": idist.broadcast("only0" if rank == 0 else None, src=0, safe_mode=True),
            "max": idist.all_reduce(torch.tensor([float(rank)]), "MAX").tolist(),
            "nproc": idist.get_nproc_per_node()}


def horovod_settings(local_rank: int) -> dict:
    """The Horovod settings that horovod.run sets in its workers, as this worker sees them."""
    return {key: os.environ.get(key) for key in HOROVOD_RUN_MISSETS}


def zero_grad_as_torch(local_rank: int) -> dict:
    """zero_grad of auto_optim's Horovod optimizer: torch's set_to_none, and Horovod's refusal while allreduces wait."""
    model = idist.auto_model(torch.nn.Linear(4, 2))
    optimizer = idist.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    model(torch.ones(3, 4)).sum().backward()  # the gradient hooks start their allreduces
    try:
        optimizer.zero_grad(set_to_none=True)
        pending = "zeroed"
    except AssertionError as exc:
        pending = str(exc)
    optimizer.step()
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    kept = [None if p.grad is None else p.grad.abs().sum().item() for p in model.parameters()]
    optimizer.zero_grad()
    return {"pending": pending, "kept": kept, "default": [p.grad for p in model.parameters()]}
