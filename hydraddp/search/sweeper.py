"""``hydra/sweeper=hydraddp_optuna``: an optuna search whose trials are launches.

The sweeper asks optuna in its own process, so every rank of a trial trains with the same values, and runs each
trial as one ``python -m hydraddp`` launch (its own job directory under the sweep's, its own MLflow run, a child of
the search's). It keeps ``n_jobs`` trials running and asks for the next the moment one ends. Sweepers given the same
``storage`` and ``study_name`` share one study; the same command run again continues it, and a trial whose sweeper
died (a pid on this host that is gone) is marked FAIL first.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import warnings
import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig

from hydraddp import lease
from hydraddp.search import space as search_space
from hydraddp.search.trial import PRUNERS, TAG_TRIAL, TAG_TRIAL_STATE, TRIAL_ENV, metric_value, pruner

DIRECTIONS = ("minimize", "maximize")
METRICS = ("eval/<name>", "train/loss", "perf/samples_per_s", "perf/mfu")
OWNER = "hydraddp_owner"  # a trial's system attribute: {"host", "pid"} of the sweeper that runs it
ERROR = "hydraddp_error"  # a failed trial's user attribute: why its launch failed


class OptunaSearch(Sweeper):
    """The sweeper's work; Hydra instantiates it as ``hydra_plugins.hydraddp_optuna_sweeper.sweeper.HydraddpOptunaSweeper``
    (Hydra takes sweepers from its plugin package only)."""

    def __init__(self, n_trials: int, n_jobs: int, direction: str, storage: str | None, study_name: str | None,
                 sampler: Any, params: dict[str, str] | None, metric: str, pruner: str) -> None:
        self.n_trials, self.n_jobs, self.direction = n_trials, n_jobs, direction
        self.storage, self.study_name, self.sampler = storage, study_name, sampler
        self.params, self.metric, self.pruner = dict(params or {}), metric, pruner
        self.config: DictConfig | None = None
        self.hydra_context: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context

    # -- the search ----------------------------------------------------------------------------------------------
    def sweep(self, arguments: list[str]) -> Any:
        assert self.config is not None
        space = self._checked_space(arguments)  # first: without optuna, that is an exit 2 too
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # its matplotlib plots
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        storage = self.storage or f"sqlite:///{Path.cwd().resolve() / 'optuna.db'}"
        with _creating(storage):
            study = optuna.create_study(study_name=self.study_name or default_study_name(space, self.metric),
                                        storage=storage, sampler=self._sampler(), pruner=pruner(self.pruner),
                                        direction=self.direction, load_if_exists=True)
        for failed in fail_orphans(study):
            print(f"hydraddp search: trial {failed} was running when its sweeper died: marked FAIL", flush=True)
        print(f"hydraddp search: study {study.study_name!r} in {storage}: {self.n_trials} trials, {self.n_jobs} at "
              f"a time, {self.direction} {self.metric}", flush=True)
        tracker = _SearchRun.of(self.config)
        running: dict[concurrent.futures.Future, Any] = {}
        failures = 0
        with concurrent.futures.ThreadPoolExecutor(self.n_jobs) as pool:
            while True:
                while len(running) < self.n_jobs and counted(study) < self.n_trials and failures < self.n_trials:
                    trial = study.ask(space.distributions)
                    study._storage.set_trial_system_attr(trial._trial_id, OWNER,
                                                         {"host": socket.gethostname(), "pid": os.getpid()})
                    overrides = space.fixed + [search_space.as_override(k, v) for k, v in trial.params.items()]
                    print(f"hydraddp search: trial {trial.number}: {' '.join(overrides[len(space.fixed):])}",
                          flush=True)
                    spec = {"storage": storage, "study": study.study_name, "trial_id": trial._trial_id,
                            "number": trial.number, "metric": self.metric, "pruner": self.pruner,
                            "keys": list(trial.params)}
                    running[pool.submit(run_trial, overrides, sweep_dir / f"trial-{trial.number}", spec)] = trial
                if not running:
                    break
                done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    trial = running.pop(future)
                    state = self._tell(study, trial, future.result())
                    failures += state == "FAIL"
                    if tracker is not None:
                        tracker.trial_ended(study, trial.number, state, future.result().get("run_id"))
        print(results_table(study), flush=True)
        if tracker is not None:
            tracker.finish(study)
        return study

    def _tell(self, study: Any, trial: Any, outcome: dict[str, Any]) -> str:
        from optuna.trial import TrialState

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
            said = f"FAIL: {error.strip().splitlines()[-1] if error.strip() else error}"
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
            found += config_problems(space, self.hydra_context.config_loader, self.config)
        if found:
            print("hydraddp: invalid search; no trial was started:", file=sys.stderr)
            for problem in found:
                print(f"- {problem}", file=sys.stderr)
            raise LaunchEnded(EXIT_INVALID)
        assert space is not None
        return space

    def _sampler(self) -> Any:
        """Hydra instantiated ``sampler`` with the sweeper (its ``_target_``); None is optuna's default."""
        from hydra.utils import instantiate

        if isinstance(self.sampler, (dict, DictConfig)):
            return instantiate(self.sampler)
        return self.sampler


def config_problems(space: search_space.Space, loader: Any, config: DictConfig) -> list[str]:
    """What a launch would refuse, for the search space at a value every trial can take (the low end, the first
    choice), each naming the searched keys. Composed by Hydra's own loader, as its launchers compose a job's."""
    from hydra.errors import HydraException

    from hydraddp.config.compose import normalize_overrides
    from hydraddp.preflight.config import problems

    overrides = normalize_overrides(space.fixed + search_space.representative(space))
    searched = ", ".join(space.distributions)
    try:
        cfg = loader.load_sweep_config(config, overrides)
    except (HydraException, ValueError) as exc:
        return [f"the search over {searched} does not compose: {exc}"]
    return [f"{problem} (searching {searched})" for problem in problems(cfg)]


@contextlib.contextmanager
def _creating(storage: str) -> Iterator[None]:
    """Two sweepers starting at once on a fresh SQLite file both create optuna's tables, and one fails ("table
    studies already exists"): they take turns under a lease beside the file (``hydraddp.lease``: not ``flock``, which
    on cluster mounts locks on each node alone; a holder that dies frees it). A database server creates its tables in
    transactions of its own."""
    from hydraddp.tracking.client import sqlite_path

    database = sqlite_path(storage)
    if database is None:
        yield
        return
    database.parent.mkdir(parents=True, exist_ok=True)
    with lease.held(database.with_name(database.name + ".lease")):
        yield


def default_study_name(space: search_space.Space, metric: str) -> str:
    """A name that the same command gives again (and so continues its study), and another search does not."""
    described = json.dumps([sorted(space.fixed), sorted((k, repr(v)) for k, v in space.distributions.items()), metric])
    return "hydraddp-" + hashlib.sha1(described.encode()).hexdigest()[:10]


def counted(study: Any) -> int:
    """The trials that count toward ``n_trials``: done (COMPLETE, PRUNED) or running; a failed one is tried again."""
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)))


def fail_orphans(study: Any) -> list[int]:
    """Mark FAIL the RUNNING trials of a sweeper on this host that is gone (a killed sweeper); a live sweeper's
    trials, and other hosts', are left as they are."""
    from optuna.trial import TrialState

    host, failed = socket.gethostname(), []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = trial.system_attrs.get(OWNER)
        if owner and owner.get("host") == host and not lease.alive(int(owner["pid"])):
            study._storage.set_trial_user_attr(trial._trial_id, ERROR, "its sweeper died while it ran")
            study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
            failed.append(trial.number)
    return failed


def run_trial(overrides: list[str], job_dir: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """One trial: ``python -m hydraddp`` with the trial's overrides in ``job_dir``; its result (``cli.RESULT_FILE``)
    and the metric's last value, or why it failed (an exit 2 gives its message)."""
    from hydraddp.cli import RESULT_FILE

    job_dir.parent.mkdir(parents=True, exist_ok=True)
    log = job_dir.parent / f"{job_dir.name}.log"
    env = {**os.environ, TRIAL_ENV: json.dumps(spec)}
    with log.open("w") as out:
        code = subprocess.call([sys.executable, "-m", "hydraddp", *overrides, f"hydra.run.dir={job_dir}"],
                               stdout=out, stderr=subprocess.STDOUT, env=env)
    result_file = job_dir / RESULT_FILE
    if code != 0 or not result_file.exists():
        said = log.read_text()[-3000:]
        return {"status": "failed", "exit_code": code, "error": f"exit {code}: {said}"}
    result = json.loads(result_file.read_text())
    value = result_metric(spec["metric"], result)
    return {"status": "ok", "value": value, "pruned_step": result.get("pruned_step"), "run_id": result.get("run_id")}


def result_metric(metric: str, result: dict[str, Any]) -> float | None:
    """The metric's last value in a launch's result: its final evaluation, its last loss, its throughput."""
    value = metric_value(metric, result.get("eval_metrics") or {}, result.get("final_loss"))
    if value is None:
        value = {"perf/samples_per_s": result.get("samples_per_s"), "perf/mfu": result.get("mfu")}.get(metric)
    return None if value is None else float(value)


def results_table(study: Any) -> str:
    rows = [f"{'trial':>5}  {'state':8} {'value':>12}  params"]
    for trial in study.get_trials(deepcopy=False):
        value = f"{trial.value:12.6g}" if trial.value is not None else "-".rjust(12)
        rows.append(f"{trial.number:>5}  {trial.state.name:8} {value}  "
                    + " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in trial.params.items()))
    try:
        best = f"best: trial {study.best_trial.number}, value {study.best_value:.6g}, {study.best_params}"
    except ValueError:
        best = "no trial completed"
    return "\nhydraddp search: study " + study.study_name + "\n" + "\n".join(rows) + "\n" + best


class _SearchRun:
    """The search's MLflow parent run (made by ``hydraddp.sweep.SweepSummary``): each trial's run tagged with its
    number and state, and the study's best value, params and child, and optuna's plots, refreshed as trials end."""

    def __init__(self, uri: str, parent_run_id: str):
        from hydraddp.tracking.client import mlflow_client

        self.uri, self.parent = uri, parent_run_id
        self.client = mlflow_client(uri)
        self.ended = 0

    @classmethod
    def of(cls, config: DictConfig) -> _SearchRun | None:
        from hydraddp.tracking.setup import PARENT_RUN_ENV, tracking_uri

        parent = os.environ.get(PARENT_RUN_ENV)
        return cls(tracking_uri(config), parent) if config.tracking.enabled and parent else None

    def trial_ended(self, study: Any, number: int, state: str, run_id: str | None) -> None:
        try:
            if run_id:
                self.client.set_tag(run_id, TAG_TRIAL, str(number))
                self.client.set_tag(run_id, TAG_TRIAL_STATE, state)
            self.ended += 1
            self._log_best(study)
        except Exception as exc:  # the study is the search's record; MLflow is its view
            print(f"hydraddp search: MLflow was not updated after trial {number}: {exc!r}", flush=True)

    def _log_best(self, study: Any) -> None:
        from hydraddp.tracking import ui

        try:
            best = study.best_trial
        except ValueError:
            return
        self.client.log_metric(self.parent, "search/best_value", float(best.value), step=self.ended)
        self.client.set_tag(self.parent, "hydraddp.best_trial", str(best.number))
        for key, value in best.params.items():
            self.client.set_tag(self.parent, f"hydraddp.best.{key}", str(value))
        run_id = _trial_run(self.client, self.parent, best.number)
        if run_id:
            base = ui.ui_base(self.uri)
            experiment = self.client.get_run(self.parent).info.experiment_id
            self.client.set_tag(self.parent, "hydraddp.best_trial_run", run_id)
            if base:
                self.client.set_tag(self.parent, "hydraddp.best_trial_url", ui.run_url(base, experiment, run_id))
        self._log_plots(study)

    def _log_plots(self, study: Any) -> None:
        import tempfile

        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from optuna.visualization import matplotlib as plots

        with tempfile.TemporaryDirectory() as tmp:
            for name, draw in (("optimization_history.png", plots.plot_optimization_history),
                               ("param_importances.png", plots.plot_param_importances)):
                try:
                    axes = draw(study)
                except (ValueError, RuntimeError):  # importances need two finished trials that differ
                    continue
                figure = axes.figure if hasattr(axes, "figure") else axes.flat[0].figure
                figure.savefig(Path(tmp, name), dpi=100, bbox_inches="tight")
                plt.close(figure)
                self.client.log_artifact(self.parent, str(Path(tmp, name)), "search")

    def finish(self, study: Any) -> None:
        try:
            best = study.best_trial
        except ValueError:
            return
        from mlflow.entities import Param

        params = [Param(f"search/best/{k}", str(v)) for k, v in best.params.items()]
        params.append(Param("search/best_trial", str(best.number)))
        existing = self.client.get_run(self.parent).data.params
        self.client.log_batch(self.parent, params=[p for p in params if p.key not in existing])
        self.client.log_metric(self.parent, "search/best_value", float(best.value), step=self.ended + 1)


def _trial_run(client: Any, parent: str, number: int) -> str | None:
    from hydraddp.tracking import names

    runs = client.search_runs([client.get_run(parent).info.experiment_id],
                              f"tags.`{names.TAG_PARENT}` = '{parent}' and tags.`{TAG_TRIAL}` = '{number}'",
                              max_results=1)
    return runs[0].info.run_id if runs else None


__all__ = ["OptunaSearch", "run_trial"]
