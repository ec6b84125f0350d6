"""The loop's data: a training loader that resumes at a saved position through its sampler, and an
evaluation loader that sees every sample exactly once, whatever the world size."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

import hydraddp.distributed as idist


class ResumableDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` whose next pass can start part-way through its epoch.

    A resumed run asks for the pass it stopped in to start at the index it had reached: the order is the
    one the uninterrupted run drew (same seed, same epoch), and no sample is loaded only to be dropped.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._start = 0

    def start_next_pass_at(self, index: int) -> None:
        self._start = index

    def __iter__(self) -> Iterator[int]:
        start, self._start = self._start, 0
        indices = list(super().__iter__())  # the epoch's permutation: indices only, no data
        return iter(indices[start:])


class EvalShardSampler(Sampler):
    """Rank r of w takes samples r, r + w, r + 2w, ...: each sample is evaluated once, with no padding
    (a padded ``DistributedSampler`` counts some samples twice when the set does not split evenly)."""

    def __init__(self, length: int, num_replicas: int, rank: int):
        self.length, self.num_replicas, self.rank = length, num_replicas, rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.length, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.num_replicas))


def _workers(num_workers: int, nproc: int) -> int:
    return -(-num_workers // nproc) if num_workers >= nproc else num_workers


def train_loader(dataset: Dataset, batch_size: int, num_workers: int, seed: int) -> DataLoader:
    """``batch_size`` and ``num_workers`` are global (split over the ranks and the node's processes, as
    ignite's auto_dataloader splits them). The loader has its own generator, so making an iterator draws
    nothing from torch's global RNG: a dropout model's random numbers do not depend on when epochs begin."""
    world, nproc = idist.get_world_size(), idist.get_nproc_per_node()
    sampler = ResumableDistributedSampler(dataset, num_replicas=world, rank=idist.get_rank(), shuffle=True, seed=seed)
    return DataLoader(dataset, batch_size=batch_size // world, sampler=sampler, drop_last=True,
                      num_workers=_workers(num_workers, nproc),
                      pin_memory=idist.device().type == "cuda", generator=torch.Generator())


def eval_loader(dataset: Dataset, batch_size: int, num_workers: int) -> DataLoader:
    world, nproc = idist.get_world_size(), idist.get_nproc_per_node()
    return DataLoader(dataset, batch_size=max(batch_size // world, 1),
                      sampler=EvalShardSampler(len(dataset), world, idist.get_rank()),
                      num_workers=_workers(num_workers, nproc),
                      pin_memory=idist.device().type == "cuda")


class Batches:
    """The training batches after ``step`` steps: the same epochs, order and worker seeds as an uninterrupted
    run. Its iterator exists once this is built (before a resume restores the RNG states)."""

    def __init__(self, loader: DataLoader, step: int, seed: int):
        self.loader, self.seed = loader, seed
        self.epoch, offset = divmod(step, len(loader))
        loader.sampler.start_next_pass_at(offset * loader.batch_size)
        self._iter = self._open()

    def _open(self) -> Iterator:
        self.loader.sampler.set_epoch(self.epoch)
        self.loader.generator.manual_seed(self.seed * 100_003 + self.epoch)  # worker seeds per (seed, epoch)
        return iter(self.loader)

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._iter)
        except StopIteration:
            self.epoch += 1
            self._iter = self._open()
            return next(self._iter)
