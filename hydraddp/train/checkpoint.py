"""Checkpoints through torch.distributed.checkpoint (DCP): sharded for fsdp/fsdp2, full for the rest, and
loadable into any other wrap mode and world size.

A checkpoint is a directory ``step_NNNNNNNN``:
- DCP files with the tensors: ``model.*`` and the optimizer's ``optim.state.*``;
- ``meta.json``: step, data position, resolved config, MLflow run id, the optimizer's param groups, the
  scheduler and grad-scaler states, the world size and wrap it was written with;
- ``rng_rank{R}.json``: every rank's RNG states; ``loader_rank{R}.json``: its training loader's state (torchdata's
  ``StatefulDataLoader``: the position, and each loader worker's RNGs).
Everything of ours that is not a tensor is JSON. DCP's own index (``.metadata``) is a pickle: it is read by a
restricted unpickler that builds DCP's metadata classes, torch sizes and dtypes and paths, and refuses any other
global (``handoff.dcp_index.reader``), so loading a checkpoint runs no code it holds. A checkpoint is written as
``step_NNNNNNNN.tmp`` and renamed only when complete: ``latest`` never sees a half-written one.

``meta.json`` names the launch that wrote it (``job_dir``, which restarts, requeues and reruns in that directory
share) and the checkpoint that launch resumed from (``resumed_from``): a restart resumes its own launch's latest,
``keep_last`` prunes only its own, a step the launch wrote before is replaced, and a launch that would write over
another's checkpoints is refused before it starts (``others_ahead``). Finding and judging the checkpoints of a root
is ``handoff.checkpoints``: the preflight reads them the same way.
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hydraddp.distributed as idist
from hydraddp.handoff.checkpoints import (META, PINNED, CheckpointError, check_matches, complete_checkpoints,
                                          read_meta, step_dir, written_by)
from hydraddp.handoff.dcp_index import reader
from hydraddp.train import rng

# torch.distributed.checkpoint is imported where it is used: it pulls in DTensor (about 0.4 s per worker),
# which a DDP run that never checkpoints has no use for before its first step.

log = logging.getLogger(__name__)


@dataclass
class Resumed:
    step: int
    meta: dict[str, Any]
    rng: dict[str, Any] | None = None  # this rank's RNG states, when the world size is the one that saved them
    loader: dict[str, Any] | None = None  # this rank's training-loader state (``data.Batches``), likewise


def _split_optimizer(optim_sd: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Tensors for DCP, param groups (plain numbers and names) for JSON."""
    tensors = {fqn: {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
               for fqn, state in optim_sd["state"].items()}
    return {"state": tensors}, optim_sd["param_groups"]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if idist.get_world_size() > 1:
        idist.barrier()


def check_shared(root: Path) -> None:
    """Refuse a checkpoint root that not every rank sees: each rank writes a marker under ``root``, then looks
    for everyone's. On several nodes a node-local path would leave each node's shards where the others (and
    a resume) never find them. A collective."""
    from hydraddp.parallel.combinations import ConfigurationError, Problem

    rank, world = idist.get_rank(), idist.get_world_size()
    folder = Path(root) / f".hydraddp-shared-{idist.broadcast(uuid.uuid4().hex if rank == 0 else '', src=0)}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{rank}").write_text(socket.gethostname())
    _barrier()
    unseen = idist.all_gather([peer for peer in range(world) if not (folder / f"rank{peer}").exists()])
    _barrier()
    shutil.rmtree(folder, ignore_errors=True)
    blind = {r: peers for r, peers in enumerate(unseen) if peers}
    if blind:
        first = min(blind)
        raise ConfigurationError(Problem(
            ("checkpoint.dir",),
            f"checkpoint.dir={root} is not shared by every node: rank {first} cannot see the markers of ranks "
            f"{blind[first]} ({len(blind)} of {world} ranks miss some), so each node would keep its own part of "
            "every checkpoint.",
            "Set checkpoint.dir to a path on storage that every node mounts at the same place (NFS, Lustre, a "
            "cluster file system), the same on every node.",
        ))


@dataclass
class PendingSave:
    """A checkpoint being written in the background (``save(..., background=True)``): its files go into ``tmp``,
    ``publish`` renames it to ``final`` once DCP's write is complete (rank 0; the others only wait for their part),
    and ``finish``, on every rank at once, raises everywhere what failed anywhere."""

    step: int
    tmp: Path
    final: Path
    future: Any  # DCP's: done when this rank's part (on rank 0: every rank's, and the index) is written
    meta: dict[str, Any]  # meta.json's content, as of the step
    root: Path
    keep_last: int
    failed: str | None = None  # None: not published yet; "": published (rank 0) or written (the others)

    def done(self) -> bool:
        return self.future.done()

    def publish(self) -> None:
        """Wait for this rank's write, then (rank 0) publish the checkpoint: ``latest`` never sees it before it is
        whole. What failed is kept for ``finish``. Not a collective: a rank calls it once its own write is ``done``."""
        if self.failed is not None:
            return
        try:
            self.future.result()
        except Exception as exc:
            self.failed = (f"the checkpoint of step {self.step} could not be written in the background "
                           f"({type(exc).__name__}: {exc}); {self.tmp} is left incomplete")
            return
        self.failed = _attempt(lambda: _complete(self.tmp, self.final, self.meta, self.root, self.keep_last))

    def finish(self) -> Path:
        """``publish``, then raise what failed on any rank on every rank. A collective: every rank calls it at the
        same point (the next save, the end of training)."""
        self.publish()
        _agree(self.failed)
        log.info("checkpoint %s written (in the background)", self.final)
        return self.final


def _attempt(publish: Any) -> str:
    """Rank 0 publishes (``publish()``); what it raised, as text ("": published, or not rank 0)."""
    if idist.get_rank() != 0:
        return ""
    try:
        publish()
    except Exception as exc:
        return str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
    return ""


def _agree(failed: str) -> None:
    """Raise what failed on any rank (``failed``: this rank's, "" for none) on every rank, as one CheckpointError. A
    collective: rank 0 raising alone would leave the others waiting for it in their next collective."""
    failures = idist.all_gather(failed) if idist.get_world_size() > 1 else [failed]
    first = next((text for text in failures if text), None)
    if first is not None:
        raise CheckpointError(first)


_background_group: Any = None


def _background_process_group() -> Any:
    """A gloo group of its own for DCP's background writes: their collectives run on another thread, beside the
    training step's on the default group (and nccl cannot gather the plans' Python objects on the host). Made once,
    by every rank (a collective), at the first background save."""
    global _background_group
    if _background_group is None:
        _background_group = dist.new_group(backend="gloo")
    return _background_group


def save(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any],
         keep_last: int = 0, loader_state: dict[str, Any] | None = None,
         background: bool = False) -> Path | PendingSave:
    """Write checkpoint ``step`` under ``root`` on every rank (a collective); returns its directory.
    ``loader_state``: this rank's training-loader state (its position, and its workers' RNGs), as JSON.

    ``background``: the state is copied (DCP's ``async_save`` stages it in host memory) and written by a thread while
    training goes on; returns a ``PendingSave`` to ``finish`` (before the next save, and at the end)."""
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if idist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    optim_tensors, param_groups = _split_optimizer(optim_sd)
    state = {"model": model_sd, "optim": optim_tensors}
    # This rank's own files first: in the background, rank 0 publishes once DCP's write is done everywhere.
    (tmp / f"rng_rank{idist.get_rank()}.json").write_text(json.dumps(rng.state()))
    if loader_state is not None:
        (tmp / f"loader_rank{idist.get_rank()}.json").write_text(json.dumps(loader_state))
    # In the background only where DCP's own collectives finish every rank's part before rank 0's index is written
    # (Horovod's ranks have none: at once), and not FSDP1's state: DCP's stager in torch 2.13 cannot copy a
    # ShardedTensor ("torch function 'data_ptr' ... not supported for ShardedTensor").
    background = background and (_distributed() or idist.get_world_size() == 1) and not _has_sharded_tensor(model_sd)
    full_meta = {**meta, "step": step, "param_groups": param_groups, "world_size": idist.get_world_size()}
    if background:
        future = dcp.async_save(state, checkpoint_id=tmp, process_group=_background_process_group()
                                if _distributed() else None, no_dist=not _distributed())
        return PendingSave(step, tmp, final, future, full_meta, Path(root), keep_last)
    if _distributed() or idist.get_rank() == 0:  # Horovod or one process: every rank holds it all; rank 0 writes
        dcp.save(state, checkpoint_id=tmp, no_dist=not _distributed())
    _barrier()
    _agree(_attempt(lambda: _complete(tmp, final, full_meta, Path(root), keep_last)))  # a barrier too
    log.info("checkpoint %s written", final)
    return final


def _has_sharded_tensor(state: dict[str, Any]) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return any(isinstance(value, ShardedTensor) for value in state.values())


def _complete(tmp: Path, final: Path, meta: dict[str, Any], root: Path, keep_last: int) -> None:
    """Rank 0, once every rank's files are in ``tmp``: the metadata, the rename, and the launch's old ones pruned."""
    (tmp / META).write_text(json.dumps(meta, indent=1, default=str))
    _publish(tmp, final, meta.get("job_dir"))
    # Only this launch's own (a root may also hold the checkpoints it resumed from), and none something refers to.
    own = [p for p in complete_checkpoints(root, launch=meta.get("job_dir")) if not (p / PINNED).exists()]
    for old in own[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def _publish(tmp: Path, final: Path, launch: str | None) -> None:
    """Rename the complete ``tmp`` to ``final``: atomic, so a reader sees the whole checkpoint or none of it. A step
    this launch wrote before (a restart, a requeue or a rerun in the same job directory redoing it) is replaced;
    another launch's is never touched (``hydraddp.job`` refuses such a launch before it starts)."""
    if final.exists():
        if written_by(final) != launch:
            raise CheckpointError(f"{final} exists, written by another launch ({written_by(final)}); this launch "
                                  f"({launch}) will not write over it. Point checkpoint.dir at a new directory.")
        replaced = final.with_name(f"{final.name}.replaced-{uuid.uuid4().hex[:8]}")
        final.rename(replaced)  # both renames are atomic; between them latest sees the step before
        tmp.rename(final)
        shutil.rmtree(replaced, ignore_errors=True)
        return
    tmp.rename(final)


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, part: bool = False,
         data_layout: list[int] | None = None) -> Resumed:
    """Load checkpoint ``path`` into this rank's (wrapped) model and optimizer, whatever wrap and world
    size wrote it (a collective). Returns the step, the metadata and this rank's saved RNG states, which
    the caller restores (``rng.restore``) once its data loader is ready. ``part``: ``model`` is a pipeline stage,
    which loads its own keys of the whole model's checkpoint. ``data_layout``: how this launch's ranks split the data
    (``resume.data_layout``); the per-rank states are used only where the checkpoint's ranks split it the same way
    (None: the world size alone decides)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    meta = read_meta(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # templates, sharded as this run shards them
    optim_tensors, param_groups = _split_optimizer(optim_sd)
    state = {"model": model_sd, "optim": optim_tensors}
    check_matches(path, state, part)
    try:
        dcp.load(state, storage_reader=reader(path), no_dist=not _distributed())
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot be loaded ({type(exc).__name__}: {exc})") from None
    for group, saved in zip(param_groups, meta["param_groups"]):  # hyperparameters as the schedule left them
        group.update({k: v for k, v in saved.items() if k != "params"})
    for fqn, tensors in optim_tensors["state"].items():
        optim_sd["state"][fqn].update(tensors)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    # At one world size under another mesh (pp=2 x dp_shard=2 against dp_shard=4), rank i may read another share of
    # the data: its loader position would be another rank's. (A checkpoint from before the layout was saved: the
    # world size alone decides, as it did.)
    same_split = (meta.get("world_size") == idist.get_world_size()
                  and (data_layout is None or meta.get("data_layout", data_layout) == data_layout))
    rank_files = [Path(path) / f"{kind}_rank{idist.get_rank()}.json" for kind in ("rng", "loader")]
    rng_states, loader = (json.loads(f.read_text()) if f.exists() and same_split else None for f in rank_files)
    log.info("resumed from %s at step %d", path, meta["step"])
    return Resumed(meta["step"], meta, rng_states, loader)
