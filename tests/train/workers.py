"""Worker functions for the checkpoint tests (run on every rank as fn(local_rank, ...))."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import hydraddp.distributed as idist
from hydraddp.train import checkpoint
from tests.distributed.workers import mlp


def killed_during_save(local_rank: int, root: str) -> None:
    """Save step 10, then die (SIGKILL, rank 0) in the middle of writing step 20."""
    model = idist.auto_model(mlp(), wrap="fsdp2")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    checkpoint.save(Path(root), 10, model, optimizer, {"config": {}})
    real_save = dcp.save

    def save_then_die(state, checkpoint_id, **kwargs):
        real_save(state, checkpoint_id=checkpoint_id, **kwargs)  # the tensors are on disk, the checkpoint is not done
        if idist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    dcp.save = save_then_die  # checkpoint imports torch.distributed.checkpoint when it saves: it sees this
    checkpoint.save(Path(root), 20, model, optimizer, {"config": {}})


def evaluate_all_digits(local_rank: int) -> dict:
    """The loop's evaluation over all 1797 digits, and the model's FLOPs per token seen before and after FSDP1."""
    from hydraddp.build import flops_per_token
    from hydraddp.data.digits import digits
    from hydraddp.models.gpt import GPT
    from hydraddp.models.mlp import MLP
    from hydraddp.train import data
    from hydraddp.train.loop import evaluate

    _, every_digit = digits(eval_fraction=1.0)
    torch.manual_seed(0)
    model = idist.auto_model(MLP())
    evaluation = evaluate(model, data.eval_loader(every_digit, 256, 0), idist.device())
    torch.manual_seed(0)
    gpt = GPT(depth=2, dim=32, heads=2, seq_len=16)
    bare_flops = flops_per_token(gpt)
    if idist.get_world_size() == 1:
        return {"evaluation": tuple(evaluation), "bare_flops": bare_flops}
    sharded = idist.auto_model(gpt, wrap="fsdp")
    return {"evaluation": tuple(evaluation), "bare_flops": bare_flops, "shard_flops": sharded.module.flops_per_token()}
