"""``hydra/sweeper=hydraddp_optuna``: an optuna search whose trials are launches.

The sweeper asks optuna in its own process, so every rank of a trial trains with the same values, and runs each
trial as the sweeper's own launch with the trial's values (``launch_arguments``: its config dir, config name and
hydra overrides, its launcher among them), in its own job directory under the sweep's, with its own MLflow run, a
child of the search's. It keeps ``n_jobs`` trials running, each on GPUs of its own (``gpu_slots``), and asks for
the next the moment one ends. Sweepers given the same ``storage`` and ``study_name`` share one study; the same
command run again continues it, and a trial whose sweeper died, on any host, is failed and tried again
(``hydraddp.search.storage``: a heartbeat).
"""

from __future__ import annotations

import concurrent.futures
import copy
import hashlib
import json
import os
import socket
import sys
import warnings
from pathlib import Path
from typing import Any

from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig

from hydraddp.search import space as search_space
from hydraddp.search import storage as studies
from hydraddp.search.launch import gpu_slots, launch_arguments, run_trial
from hydraddp.search.parent_run import SearchRun
from hydraddp.search.storage import ERROR, OWNER
from hydraddp.search.trial import PRUNERS, metric_value, pruner

DIRECTIONS = ("minimize", "maximize")
METRICS = ("eval/<name>", "train/loss", "perf/samples_per_s", "perf/mfu")
GPUS = "hydraddp_gpus"  # a local trial's user attribute: the CUDA_VISIBLE_DEVICES it ran with (gpu_slots)


class OptunaSearch(Sweeper):
    """The sweeper's work; Hydra instantiates it as ``hydra_plugins.hydraddp_optuna_sweeper.sweeper.HydraddpOptunaSweeper``
    (Hydra takes sweepers from its plugin package only)."""

    def __init__(self, n_trials: int, n_jobs: int, direction: str, storage: str | None, study_name: str | None,
                 sampler: Any, params: dict[str, str] | None, metric: str, pruner: str, heartbeat_interval: int = 30,
                 grace_period: int = 120) -> None:
        self.n_trials, self.n_jobs, self.direction = n_trials, n_jobs, direction
        self.heartbeat_interval, self.grace_period = heartbeat_interval, grace_period
        self.storage, self.study_name, self.sampler = storage, study_name, sampler
        self.params, self.metric, self.pruner = dict(params or {}), metric, pruner
        self.config: DictConfig | None = None
        self.hydra_context: Any = None
        self.gpu_slots: list[str] = []  # the CUDA_VISIBLE_DEVICES of each trial slot (gpu_slots); none: no split

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context

    # -- the search ----------------------------------------------------------------------------------------------
    def sweep(self, arguments: list[str]) -> Any:
        assert self.config is not None
        space = self._checked_space(arguments)  # first: without optuna, that is an exit 2 too
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # its matplotlib plots
        # The heartbeat is recorded by this sweeper for its trials, asked and told by hand (storage.Heartbeat).
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        storage = self._storage()
        with studies.creating(storage):
            study = optuna.create_study(study_name=self.study_name or default_study_name(space, self.metric),
                                        storage=studies.open_storage(storage, self.heartbeat_interval,
                                                                     self.grace_period, _stale),
                                        sampler=self._sampler(), pruner=pruner(self.pruner),
                                        direction=self.direction, load_if_exists=True)
        for failed in studies.fail_orphans(study):
            print(f"hydraddp search: trial {failed} was running when its sweeper died: marked FAIL", flush=True)
        print(f"hydraddp search: study {study.study_name!r} in {storage}: {self.n_trials} trials, {self.n_jobs} at "
              f"a time, {self.direction} {self.metric}", flush=True)
        tracker = SearchRun.of(self.config)
        with studies.Heartbeat(study, self.heartbeat_interval, self.grace_period, _stale) as heartbeat:
            ended = self._run_trials(study, space, sweep_dir, tracker, heartbeat)
        print(results_table(study), flush=True)
        if tracker is not None:
            tracker.finish(study)
        write_verdict(sweep_dir, study.study_name, ended)
        return study

    def _run_trials(self, study: Any, space: search_space.Space, sweep_dir: Path, tracker: SearchRun | None,
                    heartbeat: studies.Heartbeat) -> dict[str, int]:
        """Keep ``n_jobs`` trials running, each asked the moment a slot frees, until the study holds ``n_trials``
        (or as many of this sweeper's trials failed); this sweeper's trials by the state they ended in."""
        running: dict[concurrent.futures.Future, tuple[Any, str | None]] = {}  # -> the trial, its GPUs
        free_gpus = list(self.gpu_slots)  # the slots of no running trial
        ended: dict[str, int] = {}
        with concurrent.futures.ThreadPoolExecutor(self.n_jobs) as pool:
            while True:
                while len(running) < self.n_jobs and counted(study) < self.n_trials \
                        and ended.get("FAIL", 0) < self.n_trials:
                    gpus = free_gpus.pop(0) if free_gpus else None
                    trial, future = self._start_trial(pool, study, space, sweep_dir, gpus, heartbeat)
                    running[future] = (trial, gpus)
                if not running:
                    return ended
                done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    trial, gpus = running.pop(future)
                    heartbeat.remove(trial._trial_id)
                    if gpus is not None:
                        free_gpus.append(gpus)
                    state = self._tell(study, trial, future.result())
                    ended[state] = ended.get(state, 0) + 1
                    if tracker is not None:
                        tracker.trial_ended(study, trial.number, state, future.result().get("run_id"))

    def _start_trial(self, pool: concurrent.futures.Executor, study: Any, space: search_space.Space,
                     sweep_dir: Path, gpus: str | None,
                     heartbeat: studies.Heartbeat) -> tuple[Any, concurrent.futures.Future]:
        """Ask optuna for a trial and start its launch: the sweeper's own launch with the trial's values, on
        ``gpus`` (``CUDA_VISIBLE_DEVICES``) when the node's are split."""
        assert self.config is not None
        trial = study.ask(space.distributions)
        heartbeat.add(trial._trial_id)
        study._storage.set_trial_system_attr(trial._trial_id, OWNER, {"host": socket.gethostname(), "pid": os.getpid()})
        if gpus is not None:
            study._storage.set_trial_user_attr(trial._trial_id, GPUS, gpus)
        values = [search_space.as_override(k, v) for k, v in trial.params.items()]
        print(f"hydraddp search: trial {trial.number}{f' on GPUs {gpus}' if gpus else ''}: {' '.join(values)}",
              flush=True)
        spec = {"storage": self._storage(), "study": study.study_name, "trial_id": trial._trial_id,
                "number": trial.number, "metric": self.metric, "pruner": self.pruner, "keys": list(trial.params)}
        command = [sys.executable, "-m", "hydraddp", *launch_arguments(self.config), *space.fixed, *values]
        env = {} if gpus is None else {"CUDA_VISIBLE_DEVICES": gpus}
        return trial, pool.submit(run_trial, command, sweep_dir / f"trial-{trial.number}", spec, env)

    def _tell(self, study: Any, trial: Any, outcome: dict[str, Any]) -> str:
        from optuna.trial import TrialState

        stored = study._storage.get_trial(trial._trial_id).state
        if stored.is_finished():  # another sweeper failed it as stale (this one was cut off for the grace period)
            print(f"hydraddp search: trial {trial.number} ended, but the study had marked it {stored.name}", flush=True)
            return stored.name
        if outcome["status"] == "ok" and outcome.get("pruned_step") is not None:
            study.tell(trial, state=TrialState.PRUNED)
            said = f"PRUNED after step {outcome['pruned_step']}"
        elif outcome["status"] == "ok" and outcome.get("value") is not None:
            study.tell(trial, outcome["value"])
            said = f"COMPLETE, {self.metric} {outcome['value']:.6g}"
        else:
            error = outcome.get("error") or f"{self.metric} was not reported"
            study._storage.set_trial_user_attr(trial._trial_id, ERROR, error[-2000:])
            study.tell(trial, state=TrialState.FAIL)
            said = f"FAIL: {failure_line(error)}"
        print(f"hydraddp search: trial {trial.number} {said}", flush=True)
        return study._storage.get_trial(trial._trial_id).state.name

    # -- what is checked before any trial -------------------------------------------------------------------------
    def _checked_space(self, arguments: list[str]) -> search_space.Space:
        from hydraddp.cli import LaunchEnded
        from hydraddp.exit_codes import EXIT_INVALID

        found = []
        if self.direction not in DIRECTIONS:
            found.append(f"hydra.sweeper.direction={self.direction} is not one of {', '.join(DIRECTIONS)}.")
        if self.pruner not in PRUNERS:
            found.append(f"hydra.sweeper.pruner={self.pruner} is not one of {', '.join(PRUNERS)}.")
        if metric_value(self.metric, {"x": 0.0}, 0.0) is None and not self.metric.startswith("eval/") \
                and self.metric not in ("perf/samples_per_s", "perf/mfu"):
            found.append(f"hydra.sweeper.metric={self.metric} is not a metric a launch ends with: use one of "
                         f"{', '.join(METRICS)}.")
        if self.n_trials < 1 or self.n_jobs < 1:
            found.append(f"hydra.sweeper.n_trials={self.n_trials} and n_jobs={self.n_jobs} must be at least 1.")
        space = None
        try:
            space = search_space.parse([*arguments, *(f"{k}={v}" for k, v in self.params.items())])
            if not space.distributions:
                found.append("nothing to search: give a search space, e.g. "
                             "'optim.optimizer.lr=tag(log, interval(1e-5, 1e-1))' or hydra.sweeper.params.")
        except search_space.SpaceError as exc:
            found.append(str(exc))
        except ImportError as exc:
            found.append(f"hydra/sweeper=hydraddp_optuna needs optuna ({exc}): pip install 'hydraddp[search]'.")
        if space is not None and not found:
            found += storage_problems(self._storage(), self.config)
            cfg, composed = trial_config(space, self.hydra_context.config_loader, self.config)
            found += composed
            if cfg is not None and not composed:
                self.gpu_slots, unsplit = gpu_slots(cfg, self.n_jobs)
                found += unsplit
        if found:
            print("hydraddp: invalid search; no trial was started:", file=sys.stderr)
            for problem in found:
                print(f"- {problem}", file=sys.stderr)
            raise LaunchEnded(EXIT_INVALID)
        assert space is not None
        return space

    def _storage(self) -> str:
        return self.storage or f"sqlite:///{Path.cwd().resolve() / 'optuna.db'}"

    def _sampler(self) -> Any:
        """Hydra instantiated ``sampler`` with the sweeper (its ``_target_``); None is optuna's default."""
        from hydra.utils import instantiate

        if isinstance(self.sampler, (dict, DictConfig)):
            return instantiate(self.sampler)
        return self.sampler


def trial_config(space: search_space.Space, loader: Any, config: DictConfig) -> tuple[DictConfig | None, list[str]]:
    """A trial's config at a value every trial can take (the low end, the first choice), composed by Hydra's own
    loader as its launchers compose a job's (the sweeper's config dir, config name and hydra overrides; ``auto``
    values undecided), and what a launch of it would refuse, each naming the searched keys."""
    from hydra.errors import HydraException

    from hydraddp.config.compose import normalize_overrides
    from hydraddp.preflight.config import problems
    from hydraddp.sweep import before_submission_problems, submitit_launched

    overrides = normalize_overrides(space.fixed + search_space.representative(space))
    searched = ", ".join(space.distributions)
    try:
        cfg = loader.load_sweep_config(config, overrides)
    except (HydraException, ValueError) as exc:
        return None, [f"the search over {searched} does not compose: {exc}"]
    # A trial through a submitit launcher is one submitted job: checked as its submission is. (On a copy: the checks
    # decide backend=auto and launcher.nproc_per_node=auto for this machine, which a trial decides for its own.)
    checked = copy.deepcopy(cfg)
    found = before_submission_problems(checked, single_job=True) if submitit_launched(cfg) else problems(checked)
    return cfg, [f"{problem} (searching {searched})" for problem in found]


def storage_problems(storage: str, config: DictConfig) -> list[str]:
    """A study the trials' ranks cannot reach: under a launcher that runs them on other machines, rank 0 of each
    trial reports to the storage (pruning), so a file on this machine will not do."""
    from hydraddp.sweep import remote_launched

    if remote_launched(config) and not storage.startswith(studies.REMOTE_REACHABLE):
        return [f"hydra.sweeper.storage={storage} is a file on this machine, and hydra/launcher runs the trials on "
                "others, whose rank 0 reports to the study. Use a database server every node reaches, e.g. "
                "hydra.sweeper.storage=postgresql://USER:PASSWORD@HOST/DB, or a journal on a file system they "
                "share: hydra.sweeper.storage=journal:///shared/study.journal."]
    return []


def default_study_name(space: search_space.Space, metric: str) -> str:
    """A name that the same command gives again (and so continues its study), and another search does not."""
    described = json.dumps([sorted(space.fixed), sorted((k, repr(v)) for k, v in space.distributions.items()), metric])
    return "hydraddp-" + hashlib.sha1(described.encode()).hexdigest()[:10]


def counted(study: Any) -> int:
    """The trials that count toward ``n_trials``: done (COMPLETE, PRUNED) or running; a failed one is tried again."""
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)))


def _stale(study: Any, trial: Any) -> None:
    """A trial that no sweeper beat for for the grace period (its sweeper, or its host, died) was marked FAIL, and
    so is tried again."""
    print(f"hydraddp search: trial {trial.number} had no heartbeat for the grace period: marked FAIL", flush=True)


def write_verdict(sweep_dir: Path, study_name: str, ended: dict[str, int]) -> None:
    """How this sweeper's trials ended, for the search's exit status and its parent run (``hydraddp.sweep``): a
    search every trial of which failed failed; one with some failed trials (each tried again) did not."""
    failed, total = ended.get("FAIL", 0), sum(ended.values())
    verdict = {"study": study_name, "ended": ended, "all_failed": total > 0 and failed == total}
    from hydraddp.sweep import SEARCH_VERDICT_FILE

    (sweep_dir / SEARCH_VERDICT_FILE).write_text(json.dumps(verdict, indent=1))
    if verdict["all_failed"]:
        print(f"hydraddp search: every trial failed ({failed} of {failed}); see each trial's log beside its "
              f"directory in {sweep_dir}", flush=True)
    elif failed:
        print(f"hydraddp search: {failed} of {total} trials failed (each was tried again)", flush=True)


def failure_line(error: str) -> str:
    """The line of a failed launch's output that says why: its ``hydraddp:`` verdict, with the first problem it
    lists (``- key=value ...``), else its last line."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if line.startswith("hydraddp:"):
            following = lines[i + 1] if i + 1 < len(lines) and lines[i + 1].startswith("- ") else ""
            return f"{line} {following}".strip()
    return lines[-1] if lines else error


def results_table(study: Any) -> str:
    rows = [f"{'trial':>5}  {'state':8} {'value':>12}  params"]
    for trial in study.get_trials(deepcopy=False):
        value = f"{trial.value:12.6g}" if trial.value is not None else "-".rjust(12)
        rows.append(f"{trial.number:>5}  {trial.state.name:8} {value}  "
                    + " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in trial.params.items()))
        if trial.state.name == "FAIL" and trial.user_attrs.get(ERROR):
            rows.append(f"{'':>5}  {failure_line(trial.user_attrs[ERROR])}")
    try:
        best = f"best: trial {study.best_trial.number}, value {study.best_value:.6g}, {study.best_params}"
    except ValueError:
        best = "no trial completed"
    return "\nhydraddp search: study " + study.study_name + "\n" + "\n".join(rows) + "\n" + best


__all__ = ["OptunaSearch"]
