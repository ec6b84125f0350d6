"""One launch, decided before anything starts: the composed config is validated whole (its combination, ranges,
the checkpoint it resumes and the tracking server included), then resolved once into a frozen ``LaunchPlan``. The
tracker and every worker read that one object; nothing resolves or validates the config again."""

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
class LaunchPlan:
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


def _resume_after_preemption(cfg: DictConfig, job_dir: Path) -> int:
    """A launch in the job directory of a preempted one (a requeued job, or a rerun with ``hydra.run.dir``) goes on
    from its checkpoint. Returns how many preemptions the job has had (0: none)."""
    from hydraddp.train.preemption import resume_point

    checkpoint, preemptions = resume_point(job_dir)
    if checkpoint and not cfg.checkpoint.resume:
        cfg.checkpoint.resume = checkpoint
    return preemptions


def _resume_problems(cfg: DictConfig, job_dir: Path) -> tuple[list[Problem], dict[str, Any] | None]:
    """Find ``checkpoint.resume`` and check it holds the model of this config (``models.of_config``, on the meta
    device: no memory, no process group). A resumed run continues its MLflow run unless told otherwise. Returns the
    problems and where the resume starts."""
    if not cfg.checkpoint.resume:
        return [], None
    from hydraddp.models.of_config import model_of
    from hydraddp.train.checkpoint import CheckpointError, check_matches, check_readable, find, read_meta

    root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else job_dir / "checkpoints"
    try:
        path = find(root, cfg.checkpoint.resume)
        meta = read_meta(path)
        check_readable(path)
        check_matches(path, {"model": model_of(cfg.model).state_dict()})
    except CheckpointError as exc:
        return [Problem(("checkpoint.resume",), str(exc), "")], None
    cfg.checkpoint.resume = str(path.resolve())
    run_id_file = Path(meta["job_dir"], names.RUN_ID_FILE) if meta.get("job_dir") else None
    run_id = meta.get("run_id") or (run_id_file.read_text().strip() if run_id_file and run_id_file.exists() else None)
    if not cfg.tracking.run_id and run_id:
        cfg.tracking.run_id = run_id
    return [], {"checkpoint": cfg.checkpoint.resume, "step": meta["step"]}


def pretrained_problems(cfg: DictConfig, overrides: list[str]) -> list[Problem]:
    """``model.pretrained``: what it is, made an absolute path (the workers' and the run's), and for a Hugging Face
    directory the model's sizes from its ``config.json``, in ``cfg.model`` (so every check after this one, and the
    run's parameters, see the model that will train). Again on the same config, it changes nothing."""
    pretrained = cfg.model.get("pretrained")
    if not pretrained:
        return []
    from hydraddp.models import hf
    from hydraddp.train.pretrained import kind

    try:
        source = kind(pretrained)
        cfg.model.pretrained = pretrained = str(Path(pretrained).resolve())
        if source == "hf":
            if cfg.model.get("_target_") != hf.HF_TARGET:
                raise hf.PretrainedError(
                    f"model.pretrained={pretrained} is a Hugging Face model directory, which only a transformers "
                    f"model loads (model=hf_causal_lm); model._target_ is {cfg.model.get('_target_')}.")
            hf.from_hf_config(cfg.model, Path(pretrained), hf.typed_model_keys(overrides))
    except hf.PretrainedError as exc:
        return [Problem(("model.pretrained",), str(exc), "")]
    return []


def model_problems(cfg: DictConfig, overrides: list[str]) -> list[Problem]:
    """What only building the model of the config can tell, on the meta device (no memory, no process group), and
    only when asked: ``model.pretrained`` fits the model (``pretrained_problems`` first), under
    ``model.init_device=meta`` the model's initialization can be replayed after sharding, and under ``mesh.tp > 1``
    the model has a TP plan whose splits ``mesh.tp`` divides."""
    found = pretrained_problems(cfg, overrides)
    pretrained, meta = cfg.model.get("pretrained"), cfg.model.get("init_device") == "meta"
    tp = cfg.mesh.tp if cfg.wrap.name == "fsdp2" and cfg.mesh.tp > 1 else 1
    if found or (not pretrained and not meta and tp == 1):
        return found  # the usual case: no torch import before the tracker starts
    from hydraddp.parallel import meta_init
    from hydraddp.models.of_config import model_factory, model_of
    from hydraddp.train import pretrained as weights

    try:
        model = meta_init.build_on_meta(model_factory(cfg.model))[0] if meta else model_of(cfg.model)
    except meta_init.NotReplayable as exc:
        return [Problem(("model.init_device",), f"model.init_device=meta: {exc}.",
                        "Set model.init_device=cpu (built whole on every rank) or auto (whole, with a warning).")]
    wrong = pretrained and weights.mismatch(Path(pretrained), weights.kind(pretrained), model)
    if wrong:
        return [Problem(("model.pretrained",), f"model.pretrained={pretrained} does not fit this model: {wrong}. "
                        "Start from weights of the same architecture and sizes.", "")]
    if tp > 1:  # the model's plan, and every size it splits, against mesh.tp
        from hydraddp.build import tp_kwargs
        from hydraddp.parallel.tp import tp_problems

        return tp_problems(model, tp, tp_kwargs(cfg).get("tp_plan"))
    return []


def _collision_problems(cfg: DictConfig, job_dir: Path, resumed_from: dict[str, Any] | None) -> list[Problem]:
    """Refuse a launch that would write its checkpoints over another launch's: a new launch into a reused
    ``checkpoint.dir``, or a resume from step 200 where another launch's step 300 exists."""
    root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else job_dir / "checkpoints"
    if not root.is_dir():
        return []  # the usual case (a new job directory): no torch import before the tracker starts
    from hydraddp.train.checkpoint import others_ahead, written_by

    start = resumed_from["step"] if resumed_from else 0
    ahead = others_ahead(root, str(job_dir), start)
    if not ahead:
        return []
    return [Problem(("checkpoint.dir",),
                    f"checkpoint.dir={root} holds {len(ahead)} checkpoint(s) past step {start} that another launch "
                    f"wrote ({', '.join(p.name for p in ahead[:3])}, by {written_by(ahead[-1])}): this launch would "
                    "write the same steps over them, and checkpoint.resume=latest would then mix two trainings.",
                    "Point checkpoint.dir at a new directory (checkpoint.resume=PATH reads from anywhere), resume the "
                    "newest with checkpoint.resume=latest, or remove those checkpoints.")]


def _attached_problems(cfg: DictConfig, overrides: list[str]) -> list[Problem]:
    """Started by torchrun, srun or mpirun, the launcher's tasks are the ranks: a launcher.nproc_per_node typed on the
    command line that differs from the tasks on this node would silently run fewer (or more) processes."""
    launch = detect_launch_env()
    typed = [o.split("=", 1)[1] for o in overrides if o.lstrip("+~").startswith("launcher.nproc_per_node=")]
    if launch is None or not typed or int(cfg.launcher.nproc_per_node) == launch.local_world_size:
        return []
    return [Problem(("launcher.nproc_per_node",),
                    f"launcher.nproc_per_node={cfg.launcher.nproc_per_node}, but {launch.source} started "
                    f"{launch.local_world_size} task(s) on this node, and each task is one rank.",
                    f"Drop launcher.nproc_per_node (the {launch.source} tasks are the ranks), or start "
                    f"{cfg.launcher.nproc_per_node} per node (srun --ntasks-per-node={cfg.launcher.nproc_per_node}, "
                    f"torchrun --nproc_per_node={cfg.launcher.nproc_per_node}).")]


def _leads_here(cfg: DictConfig) -> bool:
    """Whether this process reports the launch and keeps its MLflow run: rank 0's process when attached, else node
    0's launcher, whose job directory is the one every node agrees on (``launch.agreed_start``). Not the
    launcher whose workers hold global rank 0: torch's rendezvous orders nodes by host and pid, not by node_rank."""
    launch = detect_launch_env()
    return launch.rank == 0 if launch is not None else cfg.launcher.node_rank == 0


def _tracking_problems(cfg: DictConfig) -> list[Problem]:
    from hydraddp.tracking.setup import preflight, tracking_uri

    unreachable = preflight(tracking_uri(cfg))
    if not unreachable:
        return []
    return [Problem(("tracking.uri",), f"tracking.uri: {unreachable}.",
                    "Start the server, point tracking.uri at one that serves it, or set tracking.enabled=false.")]


JOB_DIR_KEY = "hydraddp/job_dir"


def job_dir_from_agent(proposed: str) -> str | None:
    """The launch's job directory as torch's elastic agent keeps it, or None when no agent started us.

    The first caller sets it; the agent's store outlives restarts, so a restarted group, whose processes
    composed new directories, gets the first attempt's back, and finds its checkpoints there.
    """
    from hydraddp.distributed.comp_models.native import agent_store

    store = agent_store()
    if store is None:
        return None
    return store.compare_set(f"{JOB_DIR_KEY}/{os.environ.get('TORCHELASTIC_RUN_ID', '')}", "", proposed).decode()


def job_dir_after_restart(job_dir: Path, remove_untouched) -> tuple[Path, bool]:
    """The launch's job directory, and whether this is a restart. Rank 0 under torchrun asks the agent: after
    ``torchrun --max-restarts`` restarted the group, it goes on in the first attempt's directory, with that
    attempt's run and checkpoints, and the directory Hydra just made is removed (``remove_untouched``)."""
    attached = detect_launch_env()
    if attached is None or attached.rank != 0 or attached.world_size == 1:
        return job_dir, False
    agreed = job_dir_from_agent(str(job_dir))
    if agreed is None or Path(agreed) == job_dir:
        return job_dir, False
    remove_untouched(job_dir)
    return Path(agreed), True


def started_at(sweeping: bool, job_num: int) -> float:
    """perf/startup_s counts from the command for a launch and a sweep's first job, from its own start for the others
    (``python -m hydraddp`` puts the command's start in the environment)."""
    launched = os.environ.get(names.LAUNCHED_AT_ENV)
    return float(launched) if launched and (not sweeping or job_num == 0) else time.time()


def prepare(cfg: DictConfig, job_dir: Path, overrides: list[str], sweeping: bool, job_num: int,
            remove_untouched) -> LaunchPlan | list[Problem]:
    """Validate ``cfg`` whole, then plan the launch; or every problem found, each with its keys and the fix.

    ``cfg`` is completed in place first: ``backend=auto`` decided, and the checkpoint a resume starts from, with
    the MLflow run it continues.
    """
    from hydraddp.config.validate import combination_of, problems, resolve_backend
    from hydraddp.parallel import machine
    from hydraddp.parallel.combinations import resolve_wrap
    from hydraddp.parallel.mesh import MeshShape
    from hydraddp.parallel.mesh import realized as realized_mesh

    cfg.backend.name = resolve_backend(cfg.backend.name)
    combo = combination_of(cfg)
    found = problems(cfg, combo) + _attached_problems(cfg, overrides)
    leads = _leads_here(cfg)
    preemptions = _resume_after_preemption(cfg, job_dir) if not found else 0
    # Only the leader knows the agreed job directory (under torchrun the other ranks compose in "."): it finds and
    # checks the checkpoint, and its workers pass the path to every rank (``launch.worker``).
    if not found:  # on every process: a pretrained config sets the model's sizes, which each rank composes alone
        found += pretrained_problems(cfg, overrides)
    resume_problems, resumed_from = _resume_problems(cfg, job_dir) if not found and leads else ([], None)
    found += resume_problems
    if not found:
        found += model_problems(cfg, overrides)
    tracks = bool(cfg.tracking.enabled) and leads
    if tracks and not found:
        found += _tracking_problems(cfg)
    if found:
        return found
    job_dir, restarted = job_dir_after_restart(job_dir, remove_untouched)
    if leads and not restarted:  # (a restart goes on in the first attempt's directory: its checkpoints are its own)
        found = _collision_problems(cfg, job_dir, resumed_from)
        if found:
            return found
    wrap = resolve_wrap(combo)
    mesh = realized_mesh(MeshShape.of(cfg.mesh), wrap, combo.world_size)
    secrets = frozenset(redaction.secret_paths(OmegaConf.to_container(cfg, resolve=False)))
    config = resolve(cfg)
    return LaunchPlan(
        config=config, saved_config=redaction.redact(config, secrets), secret_paths=secrets, job_dir=job_dir,
        overrides=tuple(overrides), sweeping=sweeping, wrap=wrap, world_size=combo.world_size,
        mesh=mesh.describe() if mesh is not None else None,
        leads=leads, tracks=tracks, resumed_from=resumed_from, preemptions=preemptions, restarted=restarted,
        started_at=started_at(sweeping, job_num),
        warnings=tuple(machine.precision_warnings(cfg.precision.name, combo.cuda_device_count,
                                                  machine.cpu_has_fast_bf16())))
