"""The one answer to "will this config run here?", before any process starts.

``check`` runs every check a launch needs, in order, and returns a ``Verdict``. The config is completed and read
once into its typed ``Settings`` (``settings``), which the rules judge: its settings and its combination of backend,
wrap, precision and offload against this machine (``config``, applying ``parallel``'s rules, which ``auto_model``
applies again in a worker); the tasks a cluster launcher started and the tracking server (``environment``). The
model's checks read the config as composed, and complete it with what they find: the checkpoint a resume starts
from, ``model.pretrained``, the meta-device replay and the TP plan (``model``). Last, another launch's checkpoints
in the same root, or another launch writing there now (``claim``). The launch's ``Job`` (``hydraddp.job``) calls
it once; ``python -m hydraddp.plan`` asks ``config_problems``, the same checks without a job directory.

``cfg`` is completed in place: ``backend=auto`` and ``launcher.nproc_per_node=auto`` decided, a pretrained
directory's sizes, and the checkpoint a resume (or a preempted job's relaunch) starts from, with the MLflow run it
continues.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from hydraddp.parallel.combinations import Problem
from hydraddp.preflight.config import judge, problems
from hydraddp.preflight.environment import attached_problems, checkpoint_root_problems, tracking_problems
from hydraddp.preflight.model import model_problems, pretrained_problems, resume_after_preemption, resume_problems
from hydraddp.preflight.settings import Settings, complete, nproc_problems


@dataclass
class Verdict:
    """Every problem found (each with its keys and the fix; none: the launch may start), and what the checks
    decided on the way."""

    problems: list[Problem] = field(default_factory=list)
    settings: Settings | None = None  # the config as the rules judged it (with its combination, world and mesh)
    resumed_from: dict[str, Any] | None = None  # the checkpoint and step a resume starts from
    preemptions: int = 0  # how many preemptions the job in this directory has had
    job_dir: Path | None = None  # where the launch goes on (``settle_job_dir``'s answer)
    restarted: bool = False


def check(cfg: DictConfig, job_dir: Path, overrides: list[str], *, leads: bool,
          settle_job_dir: Callable[[Path], tuple[Path, bool]] = lambda path: (path, False)) -> Verdict:
    """Every check of a launch from ``job_dir``. ``leads``: this process reports the launch (only it knows the agreed
    job directory: it finds and checks the checkpoint, and its workers pass the path to every rank).
    ``settle_job_dir``: where a config that passes goes on (after a restart, the first attempt's directory)."""
    complete(cfg)
    if nproc_problems(cfg):
        return Verdict(nproc_problems(cfg))
    settings = Settings.of(cfg)
    found = judge(settings) + attached_problems(settings, overrides)
    preemptions = resume_after_preemption(cfg, job_dir) if not found else 0
    if not found:  # on every process: a pretrained config sets the model's sizes, which each rank composes alone
        found += pretrained_problems(cfg, overrides)
    resume, resumed_from = resume_problems(cfg, job_dir) if not found and leads else ([], None)
    found += resume
    if not found:
        found += model_problems(cfg, overrides)
    if not found and settings.config.tracking.enabled and leads:
        found += tracking_problems(settings)
    if found:
        return Verdict(found)
    job_dir, restarted = settle_job_dir(job_dir)
    if leads:  # claims checkpoint.dir until the launch ends (cli releases it): a concurrent launch is refused
        found = checkpoint_root_problems(settings, job_dir, resumed_from, restarted)
    return Verdict(found, settings, resumed_from, preemptions, job_dir, restarted)


def config_problems(cfg: DictConfig, overrides: list[str]) -> list[Problem]:
    """The checks of the config alone, as a launch makes them (no job directory, no tracking server): what
    ``python -m hydraddp.plan`` refuses."""
    return problems(cfg) or model_problems(cfg, overrides)
