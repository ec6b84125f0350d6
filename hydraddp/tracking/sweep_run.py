"""A sweep's MLflow parent run: its jobs' runs are its children; the comparison ends up on it."""

from __future__ import annotations

from pathlib import Path

import yaml

from hydraddp.tracking import names
from hydraddp.tracking.compare import COLUMNS, TABLE_JSON, TABLE_TEXT, readable
from hydraddp.tracking.client import mlflow_client


class SweepRun:
    """A sweep's parent run. At the end it holds the comparison of its children: ``loss_curves.png``,
    ``memory_per_rank.png``, ``comparison.json`` (MLflow's table layout) and ``comparison.txt``, and tags naming
    the child with the lowest final loss and the one with the most samples/s (compare.TAG_BEST_*)."""

    def __init__(self, uri: str, experiment: str, sweep_overrides: list[str]):
        """``sweep_overrides`` come redacted (``redaction.redact_overrides``): they name the run and tag it."""
        self.uri = uri
        self.client = mlflow_client(uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        description = readable(" ".join(sweep_overrides))  # as typed: experiment=quick, not experiment@_global_=...
        self.run_id = self.client.create_run(experiment_id, tags={names.TAG_SWEEP: description},
                                             run_name=names.sweep_run_name(sweep_overrides)).info.run_id
        self.client.log_text(self.run_id, yaml.safe_dump(sweep_overrides), "overrides.yaml")

    def finish(self, status: str, sweep_dir: Path) -> None:
        try:
            self._log_comparison(sweep_dir / "compare")
        except Exception as exc:  # the jobs' own runs are all there: the sweep's result must not hang on this
            print(f"hydraddp sweep: the comparison was not logged to the parent run: {exc!r}", flush=True)
        self.client.set_terminated(self.run_id, status)

    def _log_comparison(self, out_dir: Path) -> None:
        from hydraddp.tracking.compare import compare

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
        for tag, run_id in result.best.items():
            self.client.set_tag(self.run_id, tag, run_id)
