"""The search's MLflow parent run, kept up to date as trials end, off the sweeper's critical path."""

from __future__ import annotations

import concurrent.futures
import json
import os
import warnings
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from hydraddp.handoff.trial import TAG_TRIAL, TAG_TRIAL_STATE


MAX_TAG = 5000  # MLflow's limit on a tag's value (its SQL stores)


class SearchRun:
    """The search's MLflow parent run (made by ``hydraddp.sweep.SweepSummary``): each trial's run tagged with its
    number and state, and the study's best value, params and child, refreshed as trials end, and optuna's plots every
    ``PLOT_EVERY`` trials and at the end. All of it in a thread of its own: the next trial does not wait for MLflow."""

    PLOT_EVERY = 5

    def __init__(self, uri: str, parent_run_id: str, metrics: list[str]):
        from hydraddp.tracking.client import mlflow_client

        self.uri, self.parent, self.metrics = uri, parent_run_id, metrics
        self.client = mlflow_client(uri)
        self.ended = 0
        self._updates = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hydraddp-search-mlflow")

    @classmethod
    def of(cls, config: DictConfig, metrics: list[str]) -> SearchRun | None:
        from hydraddp.tracking.setup import PARENT_RUN_ENV, tracking_uri

        parent = os.environ.get(PARENT_RUN_ENV)
        return cls(tracking_uri(config), parent, metrics) if config.tracking.enabled and parent else None

    def trial_ended(self, study: Any, number: int, state: str, run_id: str | None) -> None:
        self._updates.submit(self._record, study, number, state, run_id)

    def _record(self, study: Any, number: int, state: str, run_id: str | None) -> None:
        try:
            if run_id:
                self.client.set_tag(run_id, TAG_TRIAL, str(number))
                self.client.set_tag(run_id, TAG_TRIAL_STATE, state)
            self.ended += 1
            self._log_best(study)
            if self.ended % self.PLOT_EVERY == 0:
                self._log_plots(study)
        except Exception as exc:  # the study is the search's record; MLflow is its view
            print(f"hydraddp search: MLflow was not updated after trial {number}: {exc!r}", flush=True)

    def _log_best(self, study: Any) -> None:
        if len(study.directions) > 1:
            self._log_front(study)
            return
        try:
            best = study.best_trial
        except ValueError:
            return
        self.client.log_metric(self.parent, "search/best_value", float(best.value), step=self.ended)
        self.client.set_tag(self.parent, "hydraddp.best_trial", str(best.number))
        for key, value in best.params.items():
            self.client.set_tag(self.parent, f"hydraddp.best.{key}", str(value))
        run_id, url = self._trial_link(best.number)
        if run_id:
            self.client.set_tag(self.parent, "hydraddp.best_trial_run", run_id)
        if url:
            self.client.set_tag(self.parent, "hydraddp.best_trial_url", url)

    def _log_front(self, study: Any) -> None:
        """A multi-objective search's Pareto front: ``hydraddp.pareto_front`` (its trials' numbers) and
        ``hydraddp.pareto_front_runs`` (each trial's values, params, run and link, as JSON)."""
        front = sorted(study.best_trials, key=lambda t: t.number)
        if not front:
            return
        described = []
        for trial in front:
            run_id, url = self._trial_link(trial.number)
            described.append({"trial": trial.number, "values": trial.values, "params": trial.params, "run_id": run_id,
                              "url": url})
        self.client.set_tag(self.parent, "hydraddp.pareto_front", ",".join(str(t.number) for t in front))
        self.client.set_tag(self.parent, "hydraddp.pareto_front_runs", json.dumps(described)[:MAX_TAG])

    def _trial_link(self, number: int) -> tuple[str | None, str | None]:
        """The trial's child run, and its link in MLflow's UI (None where the server has no UI)."""
        from hydraddp.tracking import ui

        run_id = _trial_run(self.client, self.parent, number)
        base = ui.ui_base(self.uri)
        if not run_id or not base:
            return run_id, None
        return run_id, ui.run_url(base, self.client.get_run(self.parent).info.experiment_id, run_id)

    def _log_plots(self, study: Any) -> None:
        import tempfile

        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from optuna.visualization import matplotlib as plots

        names = [str(m) for m in self.metrics]
        drawn = ((("pareto_front.png", lambda s: plots.plot_pareto_front(s, target_names=names)),)
                 if len(study.directions) > 1 else
                 (("optimization_history.png", plots.plot_optimization_history),
                  ("param_importances.png", plots.plot_param_importances)))
        with tempfile.TemporaryDirectory() as tmp:
            for name, draw in drawn:
                try:
                    with warnings.catch_warnings():  # importances of trials that all tie: equal, and it warns so
                        warnings.simplefilter("ignore", UserWarning)
                        axes = draw(study)
                except (ValueError, RuntimeError):  # importances need two finished trials that differ
                    continue
                figure = axes.figure if hasattr(axes, "figure") else axes.flat[0].figure
                figure.savefig(Path(tmp, name), dpi=100, bbox_inches="tight")
                plt.close(figure)
                self.client.log_artifact(self.parent, str(Path(tmp, name)), "search")

    def finish(self, study: Any) -> None:
        self._updates.shutdown(wait=True)
        try:
            self._log_plots(study)
        except Exception as exc:
            print(f"hydraddp search: optuna's plots were not logged: {exc!r}", flush=True)
        if len(study.directions) > 1:
            return  # the front's tags say it all
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
