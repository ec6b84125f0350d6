"""A fresh SQLite store that several processes open at once (node 0's tracker and the other nodes', at a launch's
start) is created once: every process gets a working client, and the store is whole afterwards. Each process has
``fcntl.flock`` a no-op that always succeeds, as on NFS with ``local_lock``: they take turns under a lease."""

from __future__ import annotations

import multiprocessing

OPENERS = 4


def _open_and_log(uri: str, start, results) -> None:
    import fcntl

    fcntl.flock = lambda *args, **kwargs: None  # as on NFS local_lock: every process gets every lock at once
    from hydraddp.tracking.client import mlflow_client

    start.wait()
    try:
        client = mlflow_client(uri)
        experiment = client.get_experiment_by_name("hydraddp")
        experiment_id = experiment.experiment_id if experiment else None
        results.put(("ok", experiment_id))
    except Exception as exc:  # noqa: BLE001 - the test reports what failed in which process
        results.put(("failed", f"{type(exc).__name__}: {exc}"))


def test_processes_opening_a_fresh_sqlite_store_together_all_get_a_whole_store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    context = multiprocessing.get_context("spawn")
    start, results = context.Event(), context.Queue()
    openers = [context.Process(target=_open_and_log, args=(uri, start, results)) for _ in range(OPENERS)]
    for process in openers:
        process.start()
    start.set()  # all at the same moment, as the nodes of one launch do
    outcomes = [results.get(timeout=120) for _ in openers]
    for process in openers:
        process.join(timeout=60)
    assert [status for status, _ in outcomes] == ["ok"] * OPENERS, outcomes

    from mlflow.tracking import MlflowClient

    assert not (tmp_path / "mlflow.db.lease").exists()  # the last to take its turn removed it
    client = MlflowClient(uri)  # a later client finds the store whole
    run = client.create_run(client.create_experiment("after")).info
    client.log_metric(run.run_id, "loss", 1.0, step=1)
    assert client.get_metric_history(run.run_id, "loss")[0].value == 1.0


def _schema(database) -> tuple[str, list[str]]:
    import sqlite3

    with sqlite3.connect(database) as db:
        revision = db.execute("select version_num from alembic_version").fetchone()[0]
        tables = sorted(row[0] for row in db.execute("select name from sqlite_master where type = 'table'"))
    return revision, tables


def test_a_new_store_is_a_copy_of_an_empty_one_as_mlflow_makes_it(tmp_path, monkeypatch):
    """A new store is copied from an empty one (tables only, made once per MLflow version in the user's cache) instead
    of running MLflow's migrations again: it has MLflow's own schema, and its Default experiment's artifacts go where
    that store is used, not where the empty one was made."""
    from mlflow.tracking import MlflowClient

    from hydraddp.tracking.client import mlflow_client

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    by_mlflow = tmp_path / "by_mlflow.db"
    MlflowClient(f"sqlite:///{by_mlflow}").search_experiments()
    for name in ("first", "second"):  # the first makes the empty store, the second only copies it
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)
        client = mlflow_client(f"sqlite:///{tmp_path / name / 'mlflow.db'}")
        assert client.get_experiment("0").artifact_location.startswith(str(tmp_path / name))
        run = client.create_run("0").info
        client.log_metric(run.run_id, "loss", 1.0, step=1)
        assert client.get_metric_history(run.run_id, "loss")[0].value == 1.0
        assert _schema(tmp_path / name / "mlflow.db") == _schema(by_mlflow)
    assert [path.name for path in (tmp_path / "cache" / "hydraddp").iterdir()] == \
        [f"mlflow-{__import__('mlflow').__version__}-empty-store.db"]
