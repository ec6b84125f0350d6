"""The loop's data: a training loader that resumes exactly where it stopped, and an evaluation loader that sees
every sample exactly once, whatever the world size.

The training loader is torchdata's ``StatefulDataLoader``: its state (the position in the epoch, and each loader
worker's RNGs through ``WorkerRng``) goes into the checkpoint, so random augmentation in workers resumes as the
uninterrupted run drew it. An ``IterableDataset`` is dealt over ranks and loader workers (``RankShard``), and its
position is part of that state too. At another world size, a map-style set resumes through its sampler at the
step's position (``ResumableDistributedSampler``).
"""

from __future__ import annotations

import itertools
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

import hydraddp.distributed as idist
from hydraddp.parallel.mesh import MeshShape
from hydraddp.train import rng

log = logging.getLogger("hydraddp.train.loop")


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


class WorkerRng(Dataset):
    """``dataset`` as it is, plus a state for ``StatefulDataLoader``: the RNG states of the loader worker that runs
    it. A resumed worker starts with them, so a random augmentation draws what the uninterrupted run drew (torch
    seeds a worker once, when it starts)."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def state_dict(self) -> dict[str, Any]:
        return {"rng": rng.state(cuda=False)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rng.restore(state["rng"])


class RankShard(IterableDataset):
    """An ``IterableDataset`` dealt over ranks and loader workers: item ``i`` of a pass goes to shard
    ``i mod (ranks x workers)``. Its position is its state, so a resumed loader skips what was consumed."""

    def __init__(self, dataset: IterableDataset, rank: int, world: int):
        self.dataset, self.rank, self.world = dataset, rank, world
        self.position, self._items = 0, iter(())

    def _start(self, position: int) -> None:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        shards = self.world * workers
        mine = itertools.islice(self.dataset, self.rank * workers + worker, None, shards)
        self.position, self._items = position, itertools.islice(mine, position, None)

    def __iter__(self) -> RankShard:
        self._start(0)
        return self

    def __next__(self) -> Any:
        item = next(self._items)
        self.position += 1
        return item

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._start(state["position"])


def readers(mesh: MeshShape | None = None) -> tuple[int, int]:
    """(this rank's share, how many shares): the data-parallel rank and degree of ``mesh`` (resolved), whose TP
    groups each read one share; without a mesh, every rank its own."""
    rank, world = idist.get_rank(), idist.get_world_size()
    return (mesh.data_parallel_rank(rank), mesh.dp) if mesh is not None else (rank, world)


def train_loader(dataset: Dataset, batch_size: int, num_workers: int, seed: int,
                 mesh: MeshShape | None = None) -> StatefulDataLoader:
    """``batch_size`` and ``num_workers`` are global (split over the data-parallel ranks (``readers``) and the node's
    processes, as ignite's auto_dataloader splits them). The loader has its own generator, so making an iterator draws
    nothing from torch's global RNG: a dropout model's random numbers do not depend on when epochs begin."""
    (rank, world), nproc = readers(mesh), idist.get_nproc_per_node()
    workers = _workers(num_workers, nproc)
    settings = {"batch_size": batch_size // world, "num_workers": workers,
                "pin_memory": idist.device().type == "cuda", "generator": torch.Generator()}
    if isinstance(dataset, IterableDataset):
        return _stateful_loader(RankShard(dataset, rank, world), drop_last=True, **settings)
    sampler = ResumableDistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    # In the main process (no workers) the checkpoint's own RNG states cover what the dataset draws.
    return _stateful_loader(WorkerRng(dataset) if workers else dataset, sampler=sampler, drop_last=True, **settings)


def _stateful_loader(dataset: Dataset, **settings: Any) -> StatefulDataLoader:
    with warnings.catch_warnings():
        # torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates: a warning on every launch, not the user's
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(dataset, **settings)


def eval_loader(dataset: Dataset, batch_size: int, num_workers: int, mesh: MeshShape | None = None) -> DataLoader:
    (rank, world), nproc = readers(mesh), idist.get_nproc_per_node()
    return DataLoader(dataset, batch_size=max(batch_size // world, 1),
                      sampler=EvalShardSampler(len(dataset), world, rank),
                      num_workers=_workers(num_workers, nproc),
                      pin_memory=idist.device().type == "cuda")


class Batches:
    """The training batches after ``step`` steps: the same epochs, order, worker seeds and worker RNGs as an
    uninterrupted run; ``data_rank`` is this rank's data-parallel rank (``readers``), which its workers' seeds mix in. ``state`` is ``state_dict()`` as a checkpoint of the same world size saved it; without it a
    map-style set starts at the step's position through its sampler, and an iterable one at its beginning. Its
    iterator exists once this is built (before a resume restores the RNG states)."""

    def __init__(self, loader: StatefulDataLoader, step: int, seed: int, state: dict[str, Any] | None = None,
                 data_rank: int = 0):
        self.loader, self.seed, self.data_rank = loader, seed, data_rank
        iterable = isinstance(loader.dataset, IterableDataset)
        if state is not None and state.get("workers") == loader.num_workers:
            self.epoch = state["epoch"]
            loader.load_state_dict(state["loader"])
        elif iterable:
            self.epoch = 0
            if step:  # another world size or worker count deals the stream differently
                log.warning("the training stream starts again from its beginning at step %d: its position was saved "
                            "at another world size or data.num_workers", step)
        else:
            self.epoch, offset = divmod(step, len(loader))
            loader.sampler.start_next_pass_at(offset * loader.batch_size)
        self._iter = self._open()

    def _open(self) -> Iterator:
        if isinstance(self.loader.sampler, DistributedSampler):
            self.loader.sampler.set_epoch(self.epoch)
        # Worker seeds per (seed, data-parallel rank, epoch): each replica's workers augment differently.
        self.loader.generator.manual_seed(rng.stream_seed(self.seed, self.data_rank, self.epoch))
        return iter(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "workers": self.loader.num_workers, "loader": self.loader.state_dict()}

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._iter)
        except StopIteration:
            self.epoch += 1
            self._iter = self._open()
            return next(self._iter)
