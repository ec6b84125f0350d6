"""The loop's checkpoint hooks: where a launch's checkpoints go, which one it resumes from, and when it saves."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig

import hydraddp.distributed as idist
from hydraddp.build import data_mesh, pipeline_stages
from hydraddp.models.hf import config_dict
from hydraddp.tracking import names
from hydraddp.tracking.events import EventWriter
from hydraddp.handoff.checkpoints import complete_checkpoints
from hydraddp.train import checkpoint, model_snapshot

log = logging.getLogger("hydraddp.train.loop")


def checkpoint_root(cfg: DictConfig, job_dir: Path | None) -> Path | None:
    if cfg.checkpoint.dir:
        return Path(cfg.checkpoint.dir)
    return Path(job_dir, "checkpoints") if job_dir is not None else None


def restart_count() -> int:
    """How many times torch's elastic agent restarted this launch's group (0: the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def restart_checkpoint(cfg: DictConfig, job_dir: Path | None) -> Path | None:
    """After an elastic restart: this launch's own latest checkpoint, not another launch's in a shared
    ``checkpoint.dir``. The workers load it; the leading process records it in the run's history."""
    root = checkpoint_root(cfg, job_dir)
    own = complete_checkpoints(root, launch=str(job_dir)) if restart_count() and root is not None else []
    return own[-1] if own else None


def resume(cfg: DictConfig, job_dir: Path | None, model, optimizer, scheduler, scaler) -> checkpoint.Resumed | None:
    """Load the checkpoint to continue from: ``checkpoint.resume``, or after an elastic restart the latest one."""
    path = cfg.checkpoint.resume
    restarted_from = restart_checkpoint(cfg, job_dir)
    if restarted_from is not None:
        path = str(restarted_from)
        log.info("restarted from %s (restart %d by torch's elastic agent)", path, restart_count())
    if not path:
        return None
    resumed = checkpoint.load(Path(path), model, optimizer, part=pipeline_stages(cfg) > 1,  # a stage: its own keys
                              data_layout=data_layout(cfg))
    if scheduler is not None and resumed.meta.get("scheduler"):
        scheduler.load_state_dict(resumed.meta["scheduler"])
    if scaler is not None and resumed.meta.get("scaler"):
        scaler.load_state_dict(resumed.meta["scaler"])
    return resumed


def data_layout(cfg: DictConfig) -> list[int]:
    """Which share of the data each rank reads, rank by rank (``[0, 1, 0, 1]`` at pp=2 x dp_shard=2, ``[0, 1, 2, 3]``
    at dp_shard=4 or under HSDP 2 x 2): a checkpoint's per-rank loader and RNG states fit a launch that splits the
    data the same way, and only that one."""
    mesh, world = data_mesh(cfg), idist.get_world_size()
    return [mesh.data_parallel_rank(rank) if mesh is not None else rank for rank in range(world)]


def needs_shared_root(cfg: DictConfig) -> bool:
    """Whether this launch reads or writes checkpoints (on several nodes: into a root every node must see)."""
    ckpt = cfg.checkpoint
    return bool(ckpt.every_n_steps or ckpt.save_last or ckpt.resume or cfg.trainer.stop_at_step)


class Saver:
    """Periodic, early-stop and final checkpoints, as ``cfg.checkpoint`` says."""

    def __init__(self, cfg: DictConfig, job_dir: Path | None, model, optimizer, scheduler, scaler,
                 saved_config: dict[str, Any], events: EventWriter | None = None,
                 loader_state: Callable[[], dict[str, Any]] | None = None):
        """``events``: the tracking rank's writer, for ``tracking.model.every_checkpoint`` (None elsewhere).
        ``loader_state``: the training loader's state now (``data.Batches.state_dict``), saved with each checkpoint."""
        self.cfg, self.job_dir, self.saved_config, self.events = cfg, job_dir, saved_config, events
        self.loader_state = loader_state
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.root = checkpoint_root(cfg, job_dir)
        self.last_saved: tuple[int, Path] | None = None
        self.pending: checkpoint.PendingSave | None = None  # the checkpoint being written in the background

    def after(self, step: int, last_step: int, batch: Any = None) -> None:
        """Checkpoint ``step`` if it is due; ``batch`` (the step's) gives a LoggedModel of it its input example.
        A periodic checkpoint is written in the background (``checkpoint.async_save``); the last one at once."""
        if self.pending is not None and self.pending.done():
            # Published as soon as it is whole: a preemption or a crash later keeps it. Each rank sees its own write
            # done at its own step, so no collective here: what failed is raised on every rank at the next ``wait``.
            self.pending.publish()
        every, ckpt, tracking = self.cfg.checkpoint.every_n_steps, self.cfg.checkpoint, self.cfg.tracking
        periodic = every and step % every == 0
        final = step == last_step and (ckpt.save_last or step == self.cfg.trainer.stop_at_step)
        if self.root is not None and (periodic or final):
            self.save(step, background=bool(ckpt.get("async_save")) and not final and step != last_step)
        # The last step's model is recorded after the final evaluation instead, with its metrics (loop.train).
        if periodic and step != last_step and self.root is not None and tracking.enabled and tracking.model.enabled \
                and tracking.model.every_checkpoint:
            model_snapshot.record_model(self.cfg, self.model, batch, step, self.events, self.job_dir, self)

    def wait(self) -> None:
        """Finish the checkpoint being written in the background, if any (rank 0 publishes it; what failed on any
        rank raises on every rank). A collective: every rank calls it before the next checkpoint and at the end."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.last_saved = (pending.step, pending.finish())

    def save(self, step: int, background: bool = False) -> Path | None:
        """Checkpoint ``step`` now (a collective), unless it is written already; its path (None without a root).
        ``background``: written by a thread while training goes on (``wait`` finishes it)."""
        if self.root is None:
            return None
        self.wait()  # one at a time; and a step written in the background is whole once this returns
        if self.last_saved is not None and self.last_saved[0] == step:
            return self.last_saved[1]
        run_id_file = Path(self.job_dir, names.RUN_ID_FILE) if self.job_dir else None
        meta = {
            "config": self.saved_config,
            "run_id": run_id_file.read_text().strip() if run_id_file and run_id_file.exists() else None,
            # The tracker may create the run after this save (it yields the CPU to training): a resume
            # then reads the run id from the job directory.
            "job_dir": str(self.job_dir) if self.job_dir else None,  # the launch that wrote it (its lineage, with:)
            "resumed_from": self.cfg.checkpoint.resume or None,
            "wrap": getattr(getattr(self.model, "_hydraddp_wrap", None), "wrap", None),
            "data_layout": data_layout(self.cfg),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            # A transformers model's own config, whole: what `export --format hf` writes (a pretrained model's
            # config.json may hold more than the model node's keys, and its directory may be gone by then).
            "hf_config": config_dict(self.model),
        }
        path = checkpoint.save(self.root, step, self.model, self.optimizer, meta, keep_last=self.cfg.checkpoint.keep_last,
                               loader_state=self.loader_state() if self.loader_state else None, background=background)
        if isinstance(path, checkpoint.PendingSave):
            self.pending = path
            return path.final
        self.last_saved = (step, path)
        return path
