"""Worker functions for the spawned core tests: each runs on every rank as fn(local_rank, ...)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import TensorDataset

import hydraddp.distributed as idist

GLOBAL_BATCH = 16


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def dataset(n: int = 128) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded fp32 parameters under clean names, whatever the wrapper (a collective)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().float().clone() for k, v in state.items()}


def train_parity(local_rank: int, wrap: str | None, precision: str, steps: int = 5, optim: str = "sgd",
                 model_kwargs: dict | None = None) -> dict:
    """A few steps on the same data and global batch: per-step global losses and final full parameters."""
    model = idist.auto_model(mlp(), wrap=wrap, precision=precision, **(model_kwargs or {}))
    if optim == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer = idist.auto_optim(optimizer)
    loader = idist.auto_dataloader(dataset(), batch_size=GLOBAL_BATCH, shuffle=False)
    losses = []
    for step, (x, y) in zip(range(steps), loader):
        x, y = x.to(idist.device()), y.to(idist.device())
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(idist.all_reduce(loss.item()) / idist.get_world_size())
    report = idist.wrap_report(model, optimizer).to_dict()
    return {"losses": losses, "params": full_params(model), "report": report, "type": type(model).__name__}
