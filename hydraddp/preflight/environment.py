"""What the place and the way of a launch can tell: the tasks a cluster launcher started, another launch's
checkpoints in the same root (or another launch writing there now), and the tracking server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydraddp.distributed.env import detect_launch_env
from hydraddp.parallel.combinations import Problem
from hydraddp.preflight import claim
from hydraddp.preflight.settings import Settings


def checkpoint_root_problems(settings: Settings, job_dir: Path, resumed_from: dict[str, Any] | None,
                             restarted: bool) -> list[Problem]:
    """The leading process claims an explicit ``checkpoint.dir`` for the whole launch (``claim``: released when the
    launch ends), then looks for another launch's checkpoints there under that claim. (The default root is in the
    launch's own job directory; a restart goes on in the first attempt's, whose checkpoints are its own.)"""
    found = claim_problems(settings, job_dir, restarted)
    if not found and not restarted:
        found = collision_problems(settings, job_dir, resumed_from)
    if found:
        claim.release()
    return found


def claim_problems(settings: Settings, job_dir: Path, restarted: bool = False) -> list[Problem]:
    """Refuse a launch into a ``checkpoint.dir`` that another launch, running now, writes: both would pass
    ``collision_problems`` at their start, then write the same steps, each over the other's."""
    if not settings.config.checkpoint.dir:
        return []
    root = Path(settings.config.checkpoint.dir)
    other = claim.claim(root, job_dir, restarted)
    if other is None:
        return []
    who = ", ".join(f"{key} {other[key]}" for key in ("job_dir", "host", "pid") if key in other) or "starting now"
    return [Problem(("checkpoint.dir",),
                    f"checkpoint.dir={root} is in use by another launch that is running now ({who}): both would "
                    "write the same steps there, each over the other's, and checkpoint.resume=latest would mix two "
                    "trainings.",
                    "Give this launch its own checkpoint.dir (or leave it unset: each launch then checkpoints into "
                    "its own job directory), or wait until that launch ends and resume from its checkpoints with "
                    "checkpoint.resume=latest.")]


def collision_problems(settings: Settings, job_dir: Path, resumed_from: dict[str, Any] | None) -> list[Problem]:
    """Refuse a launch that would write its checkpoints over another launch's: a new launch into a reused
    ``checkpoint.dir``, or a resume from step 200 where another launch's step 300 exists."""
    explicit = settings.config.checkpoint.dir
    root = Path(explicit) if explicit else job_dir / "checkpoints"
    if not root.is_dir():
        return []  # the usual case (a new job directory): no torch import before the tracker starts
    from hydraddp.handoff.checkpoints import others_ahead, written_by

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


def attached_problems(settings: Settings, overrides: list[str]) -> list[Problem]:
    """Started by torchrun, srun or mpirun, the launcher's tasks are the ranks: a launcher.nproc_per_node typed on the
    command line that differs from the tasks on this node would silently run fewer (or more) processes."""
    launch = detect_launch_env()
    typed = [o.split("=", 1)[1] for o in overrides if o.lstrip("+~").startswith("launcher.nproc_per_node=")]
    nproc = settings.config.launcher.nproc_per_node
    if launch is None or not typed or typed[-1] == "auto" or nproc == launch.local_world_size:
        return []
    return [Problem(("launcher.nproc_per_node",),
                    f"launcher.nproc_per_node={nproc}, but {launch.source} started "
                    f"{launch.local_world_size} task(s) on this node, and each task is one rank.",
                    f"Drop launcher.nproc_per_node (the {launch.source} tasks are the ranks), or start "
                    f"{nproc} per node (srun --ntasks-per-node={nproc}, torchrun --nproc_per_node={nproc}).")]


def tracking_problems(settings: Settings) -> list[Problem]:
    from hydraddp.tracking.setup import preflight, tracking_uri

    unreachable = preflight(tracking_uri(settings.config))
    if not unreachable:
        return []
    return [Problem(("tracking.uri",), f"tracking.uri: {unreachable}.",
                    "Start the server, point tracking.uri at one that serves it, or set tracking.enabled=false.")]
