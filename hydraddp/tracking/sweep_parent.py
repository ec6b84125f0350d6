"""A sweep's MLflow parent run: its jobs' runs are its children; the comparison ends up on it."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from hydraddp.tracking import names, ui
from hydraddp.tracking.comparison import (COLUMNS, MiB, RANKS_SHOWN, TABLE_JSON, TABLE_TEXT, Compared, rank_state,
                                       readable)
from hydraddp.tracking.client import mlflow_client

PREFIX = "sweep"  # the parent's comparison metrics and params: sweep/<child>/<what>, sweep/best_*
_NOT_IN_A_KEY = re.compile(r"[^\w./ -]")  # MLflow's metric and param keys: letters, digits, _ - . / and spaces
# The child metrics the parent holds, by the name it holds them under
CHILD_METRICS = {"samples_per_s": names.SAMPLES_PER_S, "mfu": names.MFU, "final_loss": names.LOSS,
                 "eval_loss": names.EVAL_LOSS}


class SweepRun:
    """A sweep's parent run. At the end it holds the comparison of its children: ``loss_curves.png``,
    ``memory_per_rank.png``, ``comparison.json`` (MLflow's table layout) and ``comparison.txt``; metrics
    ``sweep/<child>/...`` (``parent_metrics``); params and tags naming the child with the lowest final loss and the
    one with the most samples/s, by name and by link; and a saved view of its runs (``hydraddp.tracking.view``)."""

    def __init__(self, uri: str, experiment: str, sweep_overrides: list[str]):
        """``sweep_overrides`` come redacted (``redaction.redact_overrides``): they name the run and tag it."""
        self.uri, self.swept = uri, names.swept_keys(sweep_overrides)
        self.metric_keys: set[str] = set()  # of the parent and its children, once compared
        self.client = mlflow_client(uri)
        self.experiment_id = ui.experiment_id(self.client, experiment)
        description = readable(" ".join(sweep_overrides))  # as typed: experiment=quick, not experiment@_global_=...
        self.run_name = names.sweep_run_name(sweep_overrides)
        self.run_id = self.client.create_run(self.experiment_id, tags={names.TAG_SWEEP: description},
                                             run_name=self.run_name).info.run_id
        self.client.set_tag(self.run_id, names.TAG_SWEEP_ID, self.run_id)  # the UI's filter finds it with its jobs
        self.client.log_text(self.run_id, yaml.safe_dump(sweep_overrides), "overrides.yaml")

    def finish(self, status: str, sweep_dir: Path) -> None:
        try:
            self._log_comparison(sweep_dir / "compare")
        except Exception as exc:  # the jobs' own runs are all there: the sweep's result must not hang on this
            print(f"hydraddp sweep: the comparison was not logged to the parent run: {exc!r}", flush=True)
        self._print_links()
        self.client.set_terminated(self.run_id, status)  # MLflow prints its own links after ours

    def _log_comparison(self, out_dir: Path) -> None:
        from mlflow.entities import Metric, Param

        from hydraddp.tracking.comparison import compare

        try:
            result = compare(self.run_id, self.uri, out_dir)
        except SystemExit as exc:  # no child run to compare (every job was invalid)
            print(exc, flush=True)
            return
        print(result.text, flush=True)
        for path in result.plots:
            self.client.log_artifact(self.run_id, str(path))
        self.client.log_table(self.run_id, {c: [r[c] for r in result.rows] for c in COLUMNS}, TABLE_JSON)
        self.client.log_text(self.run_id, result.text + "\n", TABLE_TEXT)
        keys = child_keys(result.runs)
        metrics = [Metric(k, v, 0, 0) for k, v in parent_metrics(result.runs, keys).items()]
        self.metric_keys = {m.key for m in metrics}.union(*(run.metrics for run in result.runs))
        for i in range(0, len(metrics), 1000):  # MLflow's limit on one batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])
        named = {run.run_id: run for run in result.runs}
        params = []
        for tag, run_id in result.best.items():
            self.client.set_tag(self.run_id, tag, run_id)
            what = f"{PREFIX}/{tag.removeprefix('hydraddp.')}"  # sweep/best_loss_run
            params.append(Param(what, readable(named[run_id].name) or run_id))
            base = ui.ui_base(self.uri)
            if base:
                params.append(Param(f"{what}_url", ui.run_url(base, self.experiment_id, run_id)))
        self.client.log_batch(self.run_id, params=params)

    def _print_links(self) -> None:
        base = ui.ui_base(self.uri)
        if base is None:
            return
        from hydraddp.tracking.view import THROUGHPUT, column, save_view

        search = f"tags.`{names.TAG_SWEEP_ID}` = '{self.run_id}'"
        where: dict[str, str] = {"search_filter": search, "order_by": column("metrics", THROUGHPUT)}
        try:
            where = {"view": save_view(self.client, self.experiment_id, self.run_id, self.run_name, search,
                                       [key for key in self.swept if "." in key], self.metric_keys)}
        except Exception as exc:  # the links still show the sweep's runs, in the UI's own layout
            print(f"hydraddp sweep: the saved view was not written: {exc!r}", flush=True)
        print("hydraddp sweep: its runs in MLflow's UI:\n" + ui.open_lines(self.uri, [
            ("the runs", ui.runs_url(base, self.experiment_id, **where)),
            ("their charts", ui.runs_url(base, self.experiment_id, chart=True, **where)),
            ("the sweep's run", ui.run_url(base, self.experiment_id, self.run_id))]), flush=True)


def child_keys(runs: list[Compared]) -> dict[str, str]:
    """run id -> the part of a parent's metric key that names the child: its name, with its short id where two
    children share a name, and only characters MLflow allows in a key."""
    counts: dict[str, int] = {}
    for run in runs:
        counts[readable(run.name)] = counts.get(readable(run.name), 0) + 1
    keys = {}
    for run in runs:
        name = readable(run.name) or run.run_id[:8]
        if counts.get(readable(run.name), 0) > 1 or not run.name:
            name = f"{name}-{run.run_id[:8]}" if run.name else name
        keys[run.run_id] = _NOT_IN_A_KEY.sub("_", name)
    return keys


def parent_metrics(runs: list[Compared], keys: dict[str, str]) -> dict[str, float]:
    """``sweep/<child>/{samples_per_s,mfu,final_loss,eval_loss}`` where the child logged them, and per rank, in MiB,
    ``sweep/<child>/peak_memory_mib/rank{r}`` and ``sweep/<child>/state_mib/rank{r}`` (parameters, gradients and
    optimizer state): above ``RANKS_SHOWN`` ranks, their ``max``, ``mean`` and ``min`` instead."""
    metrics: dict[str, float] = {}
    for run in runs:
        child = f"{PREFIX}/{keys[run.run_id]}"
        for name, key in CHILD_METRICS.items():
            if key in run.metrics:
                metrics[f"{child}/{name}"] = run.metrics[key]
        per_rank = {"peak_memory_mib": {r: v / MiB for r, v in run.per_rank.get(names.PEAK_MEMORY, {}).items()},
                    "state_mib": {r: sum(parts) / MiB for r, parts in rank_state(run).items()}}
        for name, values in per_rank.items():
            if not values:
                continue
            if len(values) <= RANKS_SHOWN:
                metrics.update({f"{child}/{name}/rank{r}": v for r, v in sorted(values.items())})
            else:
                metrics.update({f"{child}/{name}/max": max(values.values()),
                                f"{child}/{name}/mean": sum(values.values()) / len(values),
                                f"{child}/{name}/min": min(values.values())})
    return metrics


__all__ = ["SweepRun", "child_keys", "parent_metrics"]
