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
import functools
import hashlib
import importlib.util
import json
import os
import socket
import sys
import warnings
from pathlib import Path
from typing import Any

from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from hydraddp.handoff.trial import PRUNERS, open_storage, pruner
from hydraddp.search import space as search_space
from hydraddp.search import storage as studies
from hydraddp.search.launch import Budget, gpu_slots, known_metric, launch_arguments, run_trial
from hydraddp.search.parent_run import SearchRun
from hydraddp.search.report import PLAN, failure_line, results_table, write_verdict
from hydraddp.search.storage import ERROR, OWNER

DIRECTIONS = ("minimize", "maximize")
SAMPLER_PACKAGES = {"CmaEsSampler": ("cmaes",), "GPSampler": ("scipy",)}  # what optuna imports when it first samples
METRICS = ("eval/<name>", "train/loss", "perf/samples_per_s", "perf/mfu", "memory/peak_gib",
           "memory/peak_tensor_gib")
GPUS = "hydraddp_gpus"  # a local trial's user attribute: the CUDA_VISIBLE_DEVICES it ran with (gpu_slots)


class OptunaSearch(Sweeper):
    """The sweeper's work; Hydra instantiates it as ``hydra_plugins.hydraddp_optuna_sweeper.sweeper.HydraddpOptunaSweeper``
    (Hydra takes sweepers from its plugin package only)."""

    def __init__(self, n_trials: int, n_jobs: int, direction: Any, storage: str | None, study_name: str | None,
                 sampler: Any, params: dict[str, str] | None, metric: Any, pruner: str, heartbeat_interval: int = 30,
                 grace_period: int = 120, memory_budget_gb: float | None = None) -> None:
        self.n_trials, self.n_jobs = n_trials, n_jobs
        # One metric and direction, or as many of each (multi-objective: optuna's Pareto front).
        self.metrics = [str(m) for m in (metric if isinstance(metric, (list, ListConfig)) else [metric])]
        self.directions = [str(d) for d in (direction if isinstance(direction, (list, ListConfig)) else [direction])]
        self.heartbeat_interval, self.grace_period = heartbeat_interval, grace_period
        self.storage, self.study_name, self.sampler = storage, study_name, sampler
        self.params, self.pruner, self.memory_budget_gb = dict(params or {}), pruner, memory_budget_gb
        self.config: DictConfig | None = None
        self.hydra_context: Any = None
        self.gpu_slots: list[str] = []  # the CUDA_VISIBLE_DEVICES of each trial slot (gpu_slots); none: no split
        self.made_sampler: Any = None  # optuna's sampler, made from ``sampler`` before the first trial

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
            study = optuna.create_study(study_name=self.study_name or default_study_name(space, self.metric_key),
                                        storage=open_storage(storage, self.heartbeat_interval,
                                                                     self.grace_period, _stale),
                                        sampler=self.made_sampler, pruner=pruner(self.pruner),
                                        directions=self.directions, load_if_exists=True)
        for failed in studies.fail_orphans(study):
            print(f"hydraddp search: trial {failed} was running when its sweeper died: marked FAIL", flush=True)
        print(f"hydraddp search: study {study.study_name!r} in {storage}: {self.n_trials} trials, {self.n_jobs} at "
              f"a time, {self.objective}", flush=True)
        tracker = SearchRun.of(self.config, self.metrics)
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
                        and ended.get("FAIL", 0) < self.n_trials and not self._grid_done(study):
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
                "number": trial.number, "metric": self.metrics[0] if len(self.metrics) == 1 else None,
                "pruner": self.pruner, "keys": list(trial.params)}
        command = [sys.executable, "-m", "hydraddp", *launch_arguments(self.config), *space.fixed, *values]
        env = {} if gpus is None else {"CUDA_VISIBLE_DEVICES": gpus}
        return trial, pool.submit(run_trial, command, sweep_dir / f"trial-{trial.number}", spec, self.metrics, env,
                                  self._budget([*space.fixed, *values]))

    def _budget(self, overrides: list[str]) -> Budget | None:
        """The memory budget the trial's plan must fit (its ``plan.budget_gb``, else
        ``hydra.sweeper.memory_budget_gb``), with its config as a launch decides it; None without a budget."""
        from hydraddp.config.compose import normalize_overrides
        from hydraddp.preflight.settings import complete, world_size

        assert self.config is not None
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, normalize_overrides(overrides))
        budget_gb = cfg.plan.get("budget_gb") or self.memory_budget_gb
        if budget_gb is None:
            return None
        with open_dict(cfg):
            del cfg["hydra"]
        complete(cfg)
        return Budget(OmegaConf.to_container(cfg, resolve=True), world_size(cfg), float(budget_gb))

    def _tell(self, study: Any, trial: Any, outcome: dict[str, Any]) -> str:
        from optuna.trial import TrialState

        stored = study._storage.get_trial(trial._trial_id).state
        if stored.is_finished():  # another sweeper failed it as stale (this one was cut off for the grace period)
            print(f"hydraddp search: trial {trial.number} ended, but the study had marked it {stored.name}", flush=True)
            return stored.name
        if outcome["status"] == "over_budget":  # never launched: the plan said it would not fit
            study._storage.set_trial_user_attr(trial._trial_id, PLAN, outcome["error"])
            study.tell(trial, state=TrialState.PRUNED)
            said = f"PRUNED: {outcome['error']}"
        elif outcome["status"] == "ok" and outcome.get("pruned_step") is not None:
            study.tell(trial, state=TrialState.PRUNED)
            said = f"PRUNED after step {outcome['pruned_step']}"
        elif outcome["status"] == "ok" and None not in outcome.get("values", [None]):
            study.tell(trial, outcome["values"])
            said = "COMPLETE, " + ", ".join(f"{m} {v:.6g}" for m, v in zip(self.metrics, outcome["values"]))
        else:
            error = outcome.get("error") or f"{', '.join(self.metrics)} not reported"
            study._storage.set_trial_user_attr(trial._trial_id, ERROR, error[-2000:])
            study.tell(trial, state=TrialState.FAIL)
            said = f"FAIL: {failure_line(error)}"
        print(f"hydraddp search: trial {trial.number} {said}", flush=True)
        return study._storage.get_trial(trial._trial_id).state.name

    # -- what is checked before any trial -------------------------------------------------------------------------
    def _checked_space(self, arguments: list[str]) -> search_space.Space:
        from hydraddp.exit_codes import EXIT_INVALID, LaunchEnded

        found = []
        found += [f"hydra.sweeper.direction={d} is not one of {', '.join(DIRECTIONS)}." for d in self.directions
                  if d not in DIRECTIONS]
        if len(self.directions) != len(self.metrics):
            found.append(f"hydra.sweeper.metric has {len(self.metrics)} metrics and hydra.sweeper.direction "
                         f"{len(self.directions)} directions: give one direction per metric, e.g. hydra.sweeper."
                         "metric=[eval/loss,perf/samples_per_s] hydra.sweeper.direction=[minimize,maximize].")
        if self.pruner not in PRUNERS:
            found.append(f"hydra.sweeper.pruner={self.pruner} is not one of {', '.join(PRUNERS)}.")
        elif self.pruner != "none" and len(self.metrics) > 1:
            found.append(f"hydra.sweeper.pruner={self.pruner} with {len(self.metrics)} metrics: optuna prunes "
                         "single-objective studies only; set hydra.sweeper.pruner=none.")
        found += [f"hydra.sweeper.metric={m} is not a metric a launch ends with: use one of {', '.join(METRICS)}."
                  for m in self.metrics if not known_metric(m)]
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
            try:
                self.made_sampler = self._made_sampler(space)
            except search_space.SpaceError as exc:
                found.append(str(exc))
            except ImportError as exc:
                found.append(f"hydra.sweeper.sampler={self.sampler.get('_target_')} needs a package that is not "
                             f"installed ({exc}): pip install 'hydraddp[search]'.")
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

    @property
    def metric_key(self) -> Any:
        """The metric, or the metrics of a multi-objective search (what names the default study)."""
        return self.metrics[0] if len(self.metrics) == 1 else self.metrics

    @property
    def objective(self) -> str:
        return ", ".join(f"{d} {m}" for d, m in zip(self.directions, self.metrics))

    def _grid_done(self, study: Any) -> bool:
        """A grid sampler has asked every combination (ask would start over)."""
        return hasattr(self.made_sampler, "is_exhausted") and self.made_sampler.is_exhausted(study)

    def _made_sampler(self, space: search_space.Space) -> Any:
        """optuna's sampler of ``hydra/sweeper/sampler`` with its settings; a grid without a ``search_space`` is
        every choice of the search space (SpaceError when one is not a choice)."""
        from hydra.utils import instantiate

        if not isinstance(self.sampler, (dict, DictConfig)):
            return self.sampler  # made already (a sweeper built in Python)
        settings = dict(self.sampler)
        for needed in SAMPLER_PACKAGES.get(str(settings.get("_target_")).rsplit(".", 1)[-1], ()):
            if importlib.util.find_spec(needed) is None:  # optuna would fail only at the first trial's sampling
                raise ImportError(f"{settings['_target_']} needs the {needed} package")
        if settings.get("_target_") == "optuna.samplers.GridSampler":
            settings["_target_"] = f"{__name__}.AskedGrid"
            settings["search_space"] = settings.get("search_space") or search_space.grid(space)
        return instantiate(settings)


@functools.cache
def _asked_grid() -> type:
    import optuna

    class AskedGrid(optuna.samplers.GridSampler):
        """optuna's grid, asked and told by hand: its ``after_trial`` stops ``study.optimize`` when the grid is
        done, which outside ``optimize`` raises; the sweeper stops asking instead (``is_exhausted``)."""

        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            pass

    return AskedGrid


def __getattr__(name: str) -> Any:  # AskedGrid, made when first named: optuna is imported only by a search
    if name == "AskedGrid":
        return _asked_grid()
    raise AttributeError(name)


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


__all__ = ["OptunaSearch"]
