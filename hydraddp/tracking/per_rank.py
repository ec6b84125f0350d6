"""Per-rank values of a large launch as one table artifact instead of one metric key per rank.

Above ``tracking.per_rank_table_above`` ranks, the tracker keeps every ``<base>/rank{r}`` metric event here (the
latest step per rank and base) instead of logging it: at 1,000 ranks that would be thousands of keys, slow to log and
to list, and unreadable in the UI. The aggregates (``<base>/max``, ``/min``, ``/mean``) and the straggler
(``perf/straggler_rank``, ``perf/straggler_step_time_s``) stay metrics. The table lives in
``<job dir>/sharding_per_rank.json`` and reaches the run as an artifact of the same name, in the split layout MLflow's
``log_table`` writes (``{"columns": ["rank", base..., base@step...], "data": [[0, v, ..., step, ...], ...]}``), which
the UI shows as a table. Only ``upload`` imports mlflow: the ranks may call ``step_time_metrics``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from hydraddp.tracking import names

log = logging.getLogger(__name__)
TABLE_FILE = "sharding_per_rank.json"  # in the job directory, and the run's artifact
DEFAULT_ABOVE = 64  # tracking.per_rank_table_above when the config does not say (the sync command passes none)
PER_RANK_KEY = re.compile(r"(?P<base>.+)/rank(?P<rank>\d+)")
STEP_SUFFIX = "@step"  # the column of the step each value was logged at: a resume may leave ranks at older steps
STRAGGLER_RANK, STRAGGLER_STEP_TIME = "perf/straggler_rank", "perf/straggler_step_time_s"
# How the UI finds a run's tables (mlflow.utils.mlflow_tags.MLFLOW_LOGGED_ARTIFACTS), as log_table sets it.
LOGGED_ARTIFACTS_TAG = "mlflow.loggedArtifacts"
TABLE_ENTRY = {"path": TABLE_FILE, "type": "table"}

Cell = tuple[int, float]  # (step, value)


def step_time_metrics(step_times: list[float]) -> dict[str, float]:
    """Every rank's seconds per step at one logged step (``step_times[r]``: rank r's), under their MLflow names:
    ``perf/step_time_s/rank{r}`` with ``/max``, ``/min``, ``/mean``, and the straggler, the slowest rank (the lowest
    on a tie) and its time. For the one rank that writes the events, once it has every rank's time.

    >>> step_time_metrics([0.5, 0.75])[STRAGGLER_RANK]
    1.0
    """
    slowest = max(range(len(step_times)), key=step_times.__getitem__)
    return {**names.per_rank_metrics(names.STEP_TIME_S, step_times),
            STRAGGLER_RANK: float(slowest), STRAGGLER_STEP_TIME: float(step_times[slowest])}


class PerRankTable:
    """The per-rank values of one run (in the tracker). Inactive, it takes nothing: every key stays a metric.

    Active, ``takes`` keeps each per-rank event, ``flush`` writes the table to the job directory (atomically: call it
    before the events it holds are committed, so a tracker that dies loses none) and ``upload`` logs it to the run,
    merged with the table a continued run already has.
    """

    def __init__(self, active: bool, job_dir: Path | None = None):
        self.active = active
        self.cells: dict[str, dict[int, Cell]] = {}  # base -> rank -> (step, value)
        self.job_dir: Path | None = None
        self._dirty = False
        if job_dir is not None:
            self.attach(job_dir)

    @classmethod
    def for_run(cls, config: dict[str, Any], tags: dict[str, str], job_dir: Path | None = None) -> PerRankTable:
        """Active when the run's ``hydraddp.world_size`` tag exceeds ``tracking.per_rank_table_above``, or when
        ``job_dir`` already keeps a table (the sync command knows neither the config nor the tags)."""
        above = ((config or {}).get("tracking") or {}).get("per_rank_table_above", DEFAULT_ABOVE)
        world = str((tags or {}).get(names.TAG_WORLD_SIZE, ""))
        kept = job_dir is not None and (Path(job_dir) / TABLE_FILE).exists()
        return cls(kept or (world.isdigit() and int(world) > int(above)), job_dir)

    def attach(self, job_dir: Path) -> None:
        """Keep the table in ``job_dir``: what it holds already (a tracker that died, a restart) is taken back,
        and an active table writes its file now, so that a later sync of this job directory keeps it too."""
        self.job_dir = Path(job_dir)
        path = self.job_dir / TABLE_FILE
        if path.exists():
            self.merge(_read(path.read_text(), str(path)))
        if self.active:
            self._dirty = self._dirty or not path.exists()
            self.flush()

    def takes(self, event: dict[str, Any]) -> bool:
        """True when the metric event ``event`` is a per-rank value this table keeps (it is then not a metric)."""
        if not self.active:
            return False
        match = PER_RANK_KEY.fullmatch(event["metric"])
        if match is None:
            return False
        self._keep(match["base"], int(match["rank"]), (int(event["step"]), float(event["value"])))
        return True

    def _keep(self, base: str, rank: int, cell: Cell, on_tie: bool = True) -> None:
        """The latest step wins; at the same step (a replay) ``cell`` wins when ``on_tie``."""
        column = self.cells.setdefault(base, {})
        old = column.get(rank)
        if old is None or cell[0] > old[0] or (on_tie and cell[0] == old[0] and cell != old):
            column[rank] = cell
            self._dirty = True

    def merge(self, cells: dict[str, dict[int, Cell]]) -> None:
        """Take in another table's cells (a file, the run's artifact) where they are later than ours."""
        for base, column in cells.items():
            for rank, cell in column.items():
                self._keep(base, rank, cell, on_tie=False)

    def to_json(self) -> dict[str, Any]:
        """The split layout of ``MlflowClient.log_table`` (``columns``, ``data``), one row per rank. Floats stay
        exact (``json`` writes their shortest round-trip form; log_table's pandas keeps 10 decimals)."""
        bases = sorted(self.cells)
        ranks = sorted({rank for column in self.cells.values() for rank in column})
        rows = []
        for rank in ranks:  # a base a rank never logged (a resume into more ranks) is null
            found = [self.cells[base].get(rank, (None, None)) for base in bases]
            rows.append([rank, *(value for _, value in found), *(step for step, _ in found)])
        return {"columns": ["rank", *bases, *(base + STEP_SUFFIX for base in bases)], "data": rows}

    def flush(self) -> None:
        """Write the table to the job directory if it changed (atomic: a crash leaves the old file or the new one)."""
        if not (self._dirty and self.active and self.job_dir is not None):
            return
        path = self.job_dir / TABLE_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json()))
        os.replace(tmp, path)
        self._dirty = False

    def upload(self, run: Any) -> None:
        """Log the table to ``run`` (a ``LaunchRun``) as ``sharding_per_rank.json``, marked as a table for the UI.
        A continued run's own table is downloaded (that one file) and merged first. Raises when the server may be
        away: the table stays in the job directory and the next upload (a sync) sends it."""
        if not self.active:
            return
        if self.job_dir is None:  # wired without a job directory: keep it there from now on
            self.attach(run.job_dir)
        client, run_id, prior = run._client, run.run_id, run._prior
        # The tag is set after the artifact: a run tagged has the table; one not tagged may still (a crash between).
        tagged = prior is not None and TABLE_ENTRY in json.loads(prior.data.tags.get(LOGGED_ARTIFACTS_TAG, "[]"))
        if tagged or (prior is not None and TABLE_FILE in {a.path for a in client.list_artifacts(run_id)}):
            self.merge(_download(run.uri, f"{prior.info.artifact_uri}/{TABLE_FILE}"))
        if not self.cells:
            return
        self._dirty = True  # even if unchanged: the file on disk is what is uploaded
        self.flush()
        client.log_artifact(run_id, str(self.job_dir / TABLE_FILE))
        if not tagged:
            logged = json.loads(client.get_run(run_id).data.tags.get(LOGGED_ARTIFACTS_TAG, "[]"))
            if TABLE_ENTRY not in logged:
                client.set_tag(run_id, LOGGED_ARTIFACTS_TAG, json.dumps([*logged, TABLE_ENTRY]))


def _download(uri: str, artifact_uri: str) -> dict[str, dict[int, Cell]]:
    """The cells of the table at ``artifact_uri`` (that one file; by its URI, so the run is not fetched again)."""
    from mlflow.artifacts import download_artifacts

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(download_artifacts(artifact_uri=artifact_uri, dst_path=tmp, tracking_uri=uri))
        return _read(path.read_text(), artifact_uri)


def _read(text: str, where: str) -> dict[str, dict[int, Cell]]:
    """The cells of a table written by ``to_json``; a table that cannot be read is left out with a warning (it
    would fail at every retry)."""
    try:
        table = json.loads(text)
        columns = table["columns"]
        if columns[:1] != ["rank"]:
            raise ValueError(f"its first column is {columns[:1]}, not rank")
        bases = [c for c in columns[1:] if not c.endswith(STEP_SUFFIX)]
        value_at = {base: columns.index(base) for base in bases}
        step_at = {base: columns.index(base + STEP_SUFFIX) for base in bases}
        cells: dict[str, dict[int, Cell]] = {base: {} for base in bases}
        for row in table["data"]:
            for base in bases:
                value, step = row[value_at[base]], row[step_at[base]]
                if value is not None:
                    cells[base][int(row[0])] = (int(step), float(value))
        return cells
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        log.warning("the per-rank table %s cannot be read (%s); it is left out", where, exc)
        return {}
