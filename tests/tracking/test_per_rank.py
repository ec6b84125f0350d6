"""Above tracking.per_rank_table_above ranks, per-rank values are one table artifact, not a metric key each: a
simulated 512-rank launch through a real LaunchRun and ``mlflow server``, its resume, a tracker killed mid-run; and
the small worlds that keep their per-rank keys."""

import json
import os
import random
import re
import signal
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hydraddp.config.compose import compose
from hydraddp.tracking import names
from hydraddp.tracking.events import EVENTS_FILE, EventWriter
from hydraddp.tracking.per_rank import (LOGGED_ARTIFACTS_TAG, STEP_SUFFIX, STRAGGLER_RANK, STRAGGLER_STEP_TIME,
                                        TABLE_FILE, PerRankTable, step_time_metrics)
from hydraddp.tracking.process import TrackerProcess
from hydraddp.tracking.run import SENT_OFFSET_FILE, LaunchRun, sync

pytestmark = pytest.mark.slow  # launches for real: see docs/development/tests.md

WORLD, LOG_EVERY = 512, 4
PER_RANK_KEY = re.compile(r".+/rank\d+")
REQUEST = re.compile(r'"(GET|POST|PUT|PATCH|DELETE) (\S+) HTTP')


def contract_tags(world: int) -> dict[str, str]:
    return {names.TAG_BACKEND: "gloo", names.TAG_WRAP: "fsdp2", names.TAG_PRECISION: "fp32",
            names.TAG_OFFLOAD: "none", names.TAG_WORLD_SIZE: str(world)}


def default_config(**tracking) -> dict:
    config = OmegaConf.to_container(compose([]), resolve=True)
    config["tracking"].update(tracking)
    return config


@dataclass
class Written:
    """What a simulated launch wrote: per base, rank -> (step, value) of its last per-rank value; per step, the loss
    and (every LOG_EVERY steps) the straggler's rank and time."""

    per_rank: dict[str, dict[int, tuple[int, float]]] = field(default_factory=dict)
    losses: dict[int, float] = field(default_factory=dict)
    stragglers: dict[int, tuple[float, float]] = field(default_factory=dict)

    def metrics(self, events: EventWriter, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            match = re.fullmatch(r"(.+)/rank(\d+)", key)
            if match:
                self.per_rank.setdefault(match[1], {})[int(match[2])] = (step, value)
        events.metrics(metrics, step)


def write_launch(job_dir: Path, first: int, last: int, seed: int, tensor_peak: bool = True) -> Written:
    """The events of a ``WORLD``-rank launch over steps ``first``..``last``, in the training loop's order
    (hydraddp/train/loop.py), with irregular full-precision values that a rounding table would not keep."""
    rng, written = random.Random(seed), Written()
    events = EventWriter(job_dir / EVENTS_FILE)
    events.tag(names.TAG_MODEL_CLASS, "tests.FakeModel")
    reports = [{"local_numel": rng.randrange(10**9), "param_bytes": rng.randrange(10**12),
                "grad_bytes": rng.randrange(10**12), "optim_state_bytes": rng.randrange(10**12)} for _ in range(WORLD)]
    written.metrics(events, names.sharding_metrics(reports), first)
    if tensor_peak:
        written.metrics(events, names.per_rank_metrics(names.PEAK_TENSOR, [rng.random() * 1e9 for _ in range(WORLD)]),
                        first + 1)
    for step in range(first, last + 1):
        loss = rng.random()
        metrics = {names.LOSS: loss, names.SAMPLES_PER_S: rng.random() * 1e4, names.STEP_TIME_S: rng.random()}
        if step % LOG_EVERY == 0:
            times = [rng.random() for _ in range(WORLD)]
            metrics.update(step_time_metrics(times))
            written.stragglers[step] = (float(times.index(max(times))), max(times))
        written.metrics(events, metrics, step)
        written.losses[step] = loss
    written.metrics(events, names.per_rank_metrics(names.PEAK_MEMORY, [rng.random() * 1e10 for _ in range(WORLD)]),
                    last)
    events.close()
    return written


def table_of(client, run_id: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        return json.loads(Path(client.download_artifacts(run_id, TABLE_FILE, tmp)).read_text())


def cells(table: dict) -> dict[str, dict[int, tuple[int, float]]]:
    """base -> rank -> (step, value), read straight from the artifact's columns."""
    columns = table["columns"]
    bases = [c for c in columns[1:] if not c.endswith(STEP_SUFFIX)]
    return {base: {row[0]: (row[columns.index(base + STEP_SUFFIX)], row[columns.index(base)])
                   for row in table["data"] if row[columns.index(base)] is not None} for base in bases}


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


@pytest.fixture(scope="module")
def launched(mlflow_server, tmp_path_factory):
    """One simulated 512-rank launch, logged by a real LaunchRun with the default config; the run as it ended."""
    job_dir = tmp_path_factory.mktemp("launch")
    written = write_launch(job_dir, 1, 20, seed=0)
    experiment = f"per-rank-{uuid.uuid4().hex[:6]}"
    run = LaunchRun(mlflow_server.uri, experiment, job_dir, default_config(), [], contract_tags(WORLD))
    run.start()
    assert run.finish("FINISHED")
    client = mlflow_server.client()
    ended = client.get_run(run.run_id)
    return {"written": written, "run": ended, "experiment": experiment, "table": table_of(client, run.run_id),
            "stragglers": history(client, run.run_id, STRAGGLER_RANK),
            "straggler_times": history(client, run.run_id, STRAGGLER_STEP_TIME)}


def test_a_512_rank_run_has_few_metric_keys_and_every_rank_exact_in_one_table(mlflow_server, launched):
    run, written = launched["run"], launched["written"]
    assert run.info.status == "FINISHED"
    keys = set(run.data.metrics)
    assert len(keys) < 100 and not any(PER_RANK_KEY.fullmatch(k) for k in keys), sorted(keys)
    bases = {*(f"sharding/{f}" for f in names.SHARDING_FIELDS), names.PEAK_MEMORY, names.PEAK_TENSOR,
             names.STEP_TIME_S}
    assert set(written.per_rank) == bases | {names.mib_key(b) for b in bases if b.endswith("_bytes")}
    for base, ranks in written.per_rank.items():  # the aggregates stay metrics, as the ranks computed them
        expected = names.per_rank_metrics(base, [ranks[r][1] for r in range(WORLD)])
        assert {k: run.data.metrics[k] for k in expected if not PER_RANK_KEY.fullmatch(k)} == \
               {k: v for k, v in expected.items() if not PER_RANK_KEY.fullmatch(k)}
    # Every rank of every base, bit for bit, with the step it was logged at.
    assert cells(launched["table"]) == written.per_rank
    assert [row[0] for row in launched["table"]["data"]] == list(range(WORLD))


def test_the_table_is_one_mlflow_reads_and_shows_as_a_table(mlflow_server, launched, monkeypatch):
    run = launched["run"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)  # load_table searches the global tracking URI
    assert {"path": TABLE_FILE, "type": "table"} in json.loads(run.data.tags[LOGGED_ARTIFACTS_TAG])
    frame = mlflow_server.client().load_table(run.info.experiment_id, TABLE_FILE, run_ids=[run.info.run_id])
    assert len(frame) == WORLD and list(frame.columns) == launched["table"]["columns"]


def test_the_straggler_is_a_metric_with_its_history(launched):
    stragglers = launched["written"].stragglers
    assert launched["stragglers"] == [(step, rank) for step, (rank, _) in sorted(stragglers.items())]
    assert launched["straggler_times"] == [(step, seconds) for step, (_, seconds) in sorted(stragglers.items())]


def requests_during(server, action) -> list[str]:
    """The API paths the server was asked for while ``action`` ran (from its access log), and ``action``'s result."""
    log_path = server.root / "server.log"
    start = log_path.stat().st_size
    result = action()
    sentinel = uuid.uuid4().hex  # the server logs a request once answered: wait until the last one is in
    urllib.request.urlopen(f"{server.uri}/health?end={sentinel}", timeout=10).close()
    deadline = time.monotonic() + 30
    while sentinel not in log_path.read_bytes()[start:].decode(errors="replace"):
        assert time.monotonic() < deadline, "the server's access log never showed the last request"
        time.sleep(0.05)
    text = log_path.read_bytes()[start:].decode(errors="replace")
    return [f"{m[1]} {m[2].split('?')[0]}" for m in REQUEST.finditer(text) if sentinel not in m[2]], result


def test_a_resume_merges_its_table_without_reading_metric_histories(mlflow_server, launched, tmp_path):
    run_id, first = launched["run"].info.run_id, launched["written"]
    # Resumed from step 12: steps 13..20 are replayed, 21..24 are new. Its first step logs the sharding again and its
    # end the memory peak; no tensor peak (not measured again), so the run's own table must keep rank 0..511's.
    resumed = write_launch(tmp_path, 13, 24, seed=1, tensor_peak=False)
    run = LaunchRun(mlflow_server.uri, launched["experiment"], tmp_path, default_config(), [], contract_tags(WORLD),
                    run_id=run_id, resuming=True, resumed_from={"checkpoint": "step_00000012", "step": 12})

    def resume():
        run.start()
        return run.finish("FINISHED")

    # What makes it take seconds at any size is what it asks the server for (below), not a timed assertion here.
    requests, finished = requests_during(mlflow_server, resume)
    assert finished
    # How far the run got came from the run's latest metrics (runs/get), never from a metric's history; the one
    # artifact read is the table it merges with.
    assert not [r for r in requests if "get-history" in r], requests
    assert "GET /api/2.0/mlflow/runs/get" in requests
    downloads = [r for r in requests if r.startswith("GET /api/2.0/mlflow-artifacts/artifacts/")]
    assert len(downloads) == 1 and downloads[0].endswith(f"/{TABLE_FILE}"), downloads

    client = mlflow_server.client()
    losses = history(client, run_id, names.LOSS)
    assert [step for step, _ in losses] == list(range(1, 25))  # no step twice: the replayed ones were not resent
    assert dict(losses) == {**first.losses, **{s: v for s, v in resumed.losses.items() if s > 20}}
    assert [step for step, _ in history(client, run_id, STRAGGLER_RANK)] == [4, 8, 12, 16, 20, 24]
    ended = client.get_run(run_id)
    assert ended.info.status == "FINISHED" and len(ended.data.metrics) < 100
    table = table_of(client, run_id)
    assert cells(table) == {**first.per_rank, **resumed.per_rank}  # the resume's later steps, the run's tensor peaks
    assert len(table["data"]) == WORLD


def test_a_tracker_killed_after_committing_its_events_loses_no_per_rank_value(mlflow_server, tmp_path):
    # The tracker dies (SIGKILL) once the offset has moved past the sharding values it took; the rest of the launch's
    # events (the memory peaks) are then sent by the sync command, which knows neither the config nor the tags.
    written = write_launch(tmp_path, 1, 8, seed=2)
    events = tmp_path / EVENTS_FILE
    data = events.read_bytes()
    cut = data.rindex(b"\n", 0, data.index(f'"{names.PEAK_MEMORY}/rank0"'.encode())) + 1
    events.write_bytes(data[:cut])
    config = default_config(system_metrics={"enabled": False, "interval_s": 10.0})
    tracker = TrackerProcess({"uri": mlflow_server.uri, "experiment": f"killed-{uuid.uuid4().hex[:6]}",
                              "job_dir": str(tmp_path), "config": config, "overrides": [], "tags": contract_tags(WORLD),
                              "run_id": None, "run_name": None, "resuming": False, "resumed_from": None})
    tracker.start()
    offset = tmp_path / SENT_OFFSET_FILE
    deadline = time.monotonic() + 120
    while not (offset.exists() and offset.read_text() == str(len(events.read_bytes()))):
        assert time.monotonic() < deadline and tracker._proc.poll() is None, "the tracker never sent the events"
        time.sleep(0.05)
    os.kill(tracker._proc.pid, signal.SIGKILL)
    tracker._proc.wait()
    with events.open("ab") as f:
        f.write(data[cut:])

    assert sync(tmp_path, mlflow_server.uri, "FINISHED") == 0
    client = mlflow_server.client()
    run_id = (tmp_path / names.RUN_ID_FILE).read_text().strip()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert not any(PER_RANK_KEY.fullmatch(k) for k in run.data.metrics), sorted(run.data.metrics)
    assert cells(table_of(client, run_id)) == written.per_rank


# -- without a server ----------------------------------------------------------------------------------------------
def event(key: str, value: float, step: int) -> dict:
    return {"metric": key, "value": value, "step": step, "ts": 0}


@pytest.mark.parametrize(("world", "config", "active"), [
    (2, {"tracking": {"per_rank_table_above": 64}}, False),
    (64, {"tracking": {"per_rank_table_above": 64}}, False),  # "above": 64 ranks still get a key each
    (65, {"tracking": {"per_rank_table_above": 64}}, True),
    (65, {}, True),  # no config (the sync command): the default threshold
    (2, {"tracking": {"per_rank_table_above": 1}}, True),
])
def test_only_worlds_above_the_threshold_keep_per_rank_values_in_a_table(world, config, active, tmp_path):
    table = PerRankTable.for_run(config, contract_tags(world), tmp_path)
    per_rank = {**names.sharding_metrics([{"local_numel": 1, "param_bytes": 2, "grad_bytes": 3,
                                           "optim_state_bytes": 4}] * world), **step_time_metrics([0.5] * world)}
    taken = {key for key, value in per_rank.items() if table.takes(event(key, value, 1))}
    assert taken == ({k for k in per_rank if PER_RANK_KEY.fullmatch(k)} if active else set())
    assert (tmp_path / TABLE_FILE).exists() == active  # nothing written for a small world


def test_the_table_in_the_job_directory_is_exact_and_rebuilds_a_tracker(tmp_path):
    table = PerRankTable.for_run({}, contract_tags(WORLD), tmp_path)
    exact = 0.1 + 0.2  # 0.30000000000000004: what a rounding writer would lose
    for key, value, step in [("memory/peak_bytes/rank3", exact, 5), ("memory/peak_bytes/rank3", 1.0, 4),
                             ("memory/peak_bytes/rank1", 2.5, 5), ("perf/step_time_s/rank0", 1e-300, 8)]:
        assert table.takes(event(key, value, step))
    assert not table.takes(event("memory/peak_bytes/max", exact, 5))
    table.flush()
    # A tracker started over the same job directory, even one without config or tags (sync), takes it back.
    again = PerRankTable.for_run({}, {}, tmp_path)
    assert again.active
    assert again.cells == {"memory/peak_bytes": {3: (5, exact), 1: (5, 2.5)}, "perf/step_time_s": {0: (8, 1e-300)}}
    again.takes(event("memory/peak_bytes/rank3", 7.0, 5))  # a replay of the same step that says otherwise: the latest
    again.merge({"memory/peak_bytes": {3: (5, 9.0), 1: (6, 3.5)}})  # another copy: only its later steps count
    assert again.cells["memory/peak_bytes"] == {3: (5, 7.0), 1: (6, 3.5)}


def test_the_straggler_is_the_slowest_rank_and_the_lowest_on_a_tie():
    metrics = step_time_metrics([0.25, 0.75, 0.5, 0.75])
    assert metrics[STRAGGLER_RANK] == 1.0 and metrics[STRAGGLER_STEP_TIME] == 0.75
    assert metrics[f"{names.STEP_TIME_S}/rank2"] == 0.5 and metrics[f"{names.STEP_TIME_S}/max"] == 0.75
