"""One launch, decided before anything starts: the composed config is checked whole, once (``preflight.check``: its
combination, ranges, model, the checkpoint it resumes and the tracking server included), then resolved once into a
frozen ``Job``. The tracker and every worker read that one object; nothing resolves or validates the config
again."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from hydraddp.parallel.combinations import Problem
from hydraddp.distributed.env import detect_launch_env
from hydraddp import redaction
from hydraddp.tracking import names


@dataclass(frozen=True)
class Job:
    """What one launch runs, and where. ``config`` is resolved (``backend=auto`` decided); treat it as read-only."""

    config: dict[str, Any]
    saved_config: dict[str, Any]  # ``config`` with every secret masked: what MLflow and checkpoints keep
    secret_paths: frozenset[str]  # dotted keys whose values are secrets (for the overrides MLflow shows)
    job_dir: Path
    overrides: tuple[str, ...]
    sweeping: bool
    wrap: str  # the realized wrapper (wrap=auto decided)
    world_size: int
    leads: bool  # this process reports the launch (result.json, the preemption marker, the done line)
    tracks: bool  # this process keeps the launch's MLflow run (it leads, and tracking is on)
    resumed_from: dict[str, Any] | None  # the checkpoint and step a resume starts from
    preemptions: int  # how many preemptions the job in this directory has had
    restarted: bool  # torch's agent restarted the group: the first attempt's job directory and run go on
    started_at: float  # time.time() of the command (the first job of a sweep) or of this job
    warnings: tuple[str, ...] = ()  # what runs, but slower than it could here (said before the launch)
    mesh: str | None = None  # the device mesh (fsdp2, ddp), e.g. "dp_replicate=2,dp_shard=2,tp=1"

    @property
    def resumes(self) -> bool:
        return bool(self.config["checkpoint"]["resume"])


def resolve(cfg: DictConfig) -> dict[str, Any]:
    """``cfg`` as plain data, every interpolation resolved: once per launch, here."""
    return OmegaConf.to_container(cfg, resolve=True)


def _leads_here(cfg: DictConfig) -> bool:
    """Whether this process reports the launch and keeps its MLflow run: rank 0's process when attached, else node
    0's launcher, whose job directory is the one every node agrees on (``launch.agreed_start``). Not the
    launcher whose workers hold global rank 0: torch's rendezvous orders nodes by host and pid, not by node_rank."""
    launch = detect_launch_env()
    return launch.rank == 0 if launch is not None else cfg.launcher.node_rank == 0


JOB_DIR_KEY = "hydraddp/job_dir"
ATTEMPTS_KEY = "hydraddp/attempts"


def _run_key(key: str) -> str:
    return f"{key}/{os.environ.get('TORCHELASTIC_RUN_ID', '')}"


def job_dir_from_agent(proposed: str) -> str | None:
    """The launch's job directory as torch's elastic agent keeps it, or None when no agent started us.

    The first caller sets it; the agent's store outlives restarts, so a restarted group, whose processes
    composed new directories, gets the first attempt's back, and finds its checkpoints there.
    """
    found = _ask_agent(proposed, count_attempt=False)
    return found[0] if found is not None else None


def _ask_agent(proposed: str, count_attempt: bool) -> tuple[str, int] | None:
    """The agreed job directory, and (``count_attempt``) which attempt of the launch this is, 1 for the first, as
    counted in the agent's store by each attempt's rank 0 (else 0); None when no agent started us."""
    from hydraddp.distributed.comp_models.native import agent_store

    store = agent_store()
    if store is None:
        return None
    agreed = store.compare_set(_run_key(JOB_DIR_KEY), "", proposed).decode()
    return agreed, store.add(_run_key(ATTEMPTS_KEY), 1) if count_attempt else 0


def _same_dir(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def job_dir_after_restart(job_dir: Path, remove_untouched) -> tuple[Path, bool]:
    """The launch's job directory, and whether this is a restart. Rank 0 under torchrun asks the agent: after
    ``torchrun --max-restarts`` restarted the group (or an elastic job lost a node), it goes on in the first
    attempt's directory, with that attempt's run and checkpoints. A directory Hydra just made elsewhere is removed
    (``remove_untouched``); the agreed one never is.

    A restart is known by what travels with the job, not by the directory (a fixed ``hydra.run.dir`` composes the
    same one every time): the attempts the agent's store counts, or torch's restart count with the first attempt's
    run id in the directory. The latter when the lost node was rank 0's: the workers' store was its agent's, and
    the survivor's agent starts a new one (torch 2.13), so only a directory every attempt names finds that run.
    """
    attached = detect_launch_env()
    # At world size 1 too: an elastic job (--nnodes=1:2) that lost a node goes on alone, in the same directory and run.
    if attached is None or attached.rank != 0:
        return job_dir, False
    found = _ask_agent(str(job_dir), count_attempt=True)  # once per attempt: only here
    if found is None:
        return job_dir, False
    from hydraddp.train.resume import restart_count  # (torch is in: the agent's store is torch's)

    agreed, attempt = Path(found[0]), found[1]
    elsewhere = not _same_dir(agreed, job_dir)
    if elsewhere:
        remove_untouched(job_dir)
    left_a_run = restart_count() > 0 and (agreed / names.RUN_ID_FILE).exists()
    return agreed, elsewhere or attempt > 1 or left_a_run


def _restart_point(cfg: DictConfig, job_dir: Path) -> dict[str, Any] | None:
    """Where a restarted group goes on (the checkpoint its workers load), for the run's ``hydraddp.resumed_from``:
    a restart into another world size (an elastic job that lost or gained a node) is recorded as a resume is."""
    from hydraddp.handoff.checkpoints import read_meta
    from hydraddp.train.resume import restart_checkpoint, restart_count

    path = restart_checkpoint(cfg, job_dir)
    return None if path is None else {"checkpoint": str(path), "step": read_meta(path)["step"], "restart": restart_count()}


def started_at(sweeping: bool, job_num: int) -> float:
    """perf/startup_s counts from the command for a launch and a sweep's first job, from its own start for the others
    (``python -m hydraddp`` puts the command's start in the environment)."""
    launched = os.environ.get(names.LAUNCHED_AT_ENV)
    return float(launched) if launched and (not sweeping or job_num == 0) else time.time()


def prepare(cfg: DictConfig, job_dir: Path, overrides: list[str], sweeping: bool, job_num: int,
            remove_untouched) -> Job | list[Problem]:
    """Validate ``cfg`` whole, then decide the launch; or every problem found, each with its keys and the fix.

    ``cfg`` is completed in place first: ``backend=auto`` decided, and the checkpoint a resume starts from, with
    the MLflow run it continues.
    """
    from hydraddp import preflight
    from hydraddp.parallel import machine
    from hydraddp.parallel.combinations import resolve_wrap
    from hydraddp.parallel.mesh import realized as realized_mesh

    leads = _leads_here(cfg)
    verdict = preflight.check(cfg, job_dir, overrides, leads=leads,
                              settle_job_dir=lambda path: job_dir_after_restart(path, remove_untouched))
    if verdict.problems:
        return verdict.problems
    combo, job_dir, resumed_from = verdict.settings.combination, verdict.job_dir, verdict.resumed_from
    if verdict.restarted and resumed_from is None:
        resumed_from = _restart_point(cfg, job_dir)
    tracks = bool(cfg.tracking.enabled) and leads
    wrap = resolve_wrap(combo)
    mesh = realized_mesh(verdict.settings.mesh, wrap, combo.world_size)
    secrets = frozenset(redaction.secret_paths(OmegaConf.to_container(cfg, resolve=False)))
    config = resolve(cfg)
    return Job(
        config=config, saved_config=redaction.redact(config, secrets), secret_paths=secrets, job_dir=job_dir,
        overrides=tuple(overrides), sweeping=sweeping, wrap=wrap, world_size=combo.world_size,
        mesh=mesh.describe() if mesh is not None else None,
        leads=leads, tracks=tracks, resumed_from=resumed_from, preemptions=verdict.preemptions,
        restarted=verdict.restarted,
        started_at=started_at(sweeping, job_num),
        warnings=tuple(machine.precision_warnings(cfg.precision.name, combo.cuda_device_count,
                                                  machine.cpu_has_fast_bf16())))
