"""Evaluation over the eval set: every rank's task sums added in one all-reduce, then summarized; a rank with fewer
batches runs forwards that count for nothing until the longest is done (a sharded model's forward is a collective)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

import hydraddp.distributed as idist
from hydraddp.train import tasks


class Evaluation(NamedTuple):
    metrics: dict[str, float]  # the task's, e.g. loss and accuracy, or loss and perplexity
    samples: int  # every sample of the eval set exactly once, summed over the ranks


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device, task: Any = None, copies: int = 1) -> Evaluation:
    """The task's metrics over the eval set: every rank's sums added in one all-reduce, then summarized. ``copies``:
    how many ranks read each batch (the ranks of a TP group), whose sums count once.

    Every rank runs the same number of forwards: a sharded model's forward holds collectives (FSDP's all-gathers),
    and a rank that ran out of batches while another still gathered crashed the group (a hang on nccl). A rank
    whose shard is shorter, or empty, runs forwards on a batch that counts for nothing until the longest is done."""
    task = task if task is not None else tasks.Classification()
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    samples = 0
    batches = len(loader)
    longest = int(idist.all_reduce(batches, op="MAX"))
    spare = None
    for batch in loader:
        batch = tasks.to_device(batch, device)
        spare = batch if spare is None else spare
        samples += tasks.batch_size(batch)
        for key, value in tasks.eval_sums(task, model, batch).items():
            sums[key] = sums.get(key, 0) + value.detach().to(device, torch.float64)
    if batches < longest:
        spare = spare if spare is not None else tasks.to_device(_one_sample_batch(loader), device)
        for _ in range(longest - batches):
            tasks.eval_sums(task, model, spare)  # the same collectives as the other ranks' forwards; counts nothing
    model.train()
    # A rank whose shard is empty has no keys yet: every rank reduces the same keys, in the same order.
    keys = sorted({key for rank_keys in idist.all_gather(sorted(sums)) for key in rank_keys})
    zero = torch.zeros((), dtype=torch.float64, device=device)
    totals = (idist.all_reduce(torch.stack([*(sums.get(k, zero) for k in keys), zero + samples])) / copies).tolist()
    return Evaluation(tasks.summarize(task, dict(zip(keys, totals))), int(totals[-1]))


def _one_sample_batch(loader) -> Any:
    """A batch of the eval set's first sample, for a rank whose shard is empty (more ranks than samples)."""
    return loader.collate_fn([loader.dataset[0]])
