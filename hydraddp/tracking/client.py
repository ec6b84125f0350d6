"""Where a launch's MLflow runs live, and the client that reaches them: what the run of node 0's tracker
(``run``), every other node's process (``node``) and the comparison share, with nothing of either.

Importing this module does not import mlflow; ``mlflow_client`` does, when it is called.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path
from typing import Iterator

from hydraddp import lease

log = logging.getLogger(__name__)

def default_uri(cwd: Path | None = None) -> str:
    return f"sqlite:///{(cwd or Path.cwd()).resolve() / 'mlflow.db'}"


def mlflow_client(uri: str):
    # We retry ourselves (the events file keeps every point); mlflow's own backoff would stall for minutes.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    from mlflow.tracking import MlflowClient

    with creating_sqlite(uri):
        database = sqlite_path(uri)
        if database is not None and not database.exists():
            _copy_empty_store(database)
        return MlflowClient(tracking_uri=uri)


def _copy_empty_store(database: Path) -> None:
    """A new SQLite store as a copy of an empty one, made once per MLflow version in the user's cache: MLflow builds
    a store's tables by running every one of its alembic migrations (1.1 of the 1.9 CPU-seconds of opening a new store
    here), at each launch in a new directory and each sweep job with its own store. The copy has tables only: MLflow
    still creates the Default experiment, with its artifact location, where the store is. Best effort: without a
    writable cache, or with an MLflow whose private ``_initialize_tables`` changed, MLflow creates the store itself."""
    try:
        import mlflow
        import sqlalchemy
        from mlflow.store.db.utils import _initialize_tables

        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hydraddp"
        empty = cache / f"mlflow-{mlflow.__version__}-empty-store.db"
        if not empty.exists():
            cache.mkdir(parents=True, exist_ok=True)
            made = empty.with_name(f"{empty.name}.{os.getpid()}")
            engine = sqlalchemy.create_engine(f"sqlite:///{made}")
            _initialize_tables(engine)
            engine.dispose()
            os.replace(made, empty)  # whole or not at all, also when two launches make it at once
        copied = database.with_name(f"{database.name}.{os.getpid()}")
        shutil.copyfile(empty, copied)
        os.replace(copied, database)
    except Exception as exc:  # noqa: BLE001 - MLflow then creates the store as it always did
        log.debug("no empty store to copy (%s); MLflow creates %s", exc, database)


@contextlib.contextmanager
def creating_sqlite(uri: str) -> Iterator[None]:
    """A SQLite file that processes may create at once (MLflow's store, an optuna study), taken in turns. MLflow
    creates and migrates a fresh SQLite store in the client's constructor; two processes doing it at the same moment
    (node 0's tracker and another node's, at a launch's start) collide ("table _alembic_tmp_experiments already
    exists") and leave it half-migrated. Every process that opens the file takes turns under a lease beside
    it (``hydraddp.lease``: not ``flock``, which on cluster mounts locks on each node alone): the first creates the
    store, the others find it made. A holder that dies frees it (on another node, once it expires)."""
    database = sqlite_path(uri)
    if database is None:
        yield
        return
    database.parent.mkdir(parents=True, exist_ok=True)
    with lease.held(database.with_name(database.name + ".lease")):
        yield


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (relative or absolute); None for any other store."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix) or len(uri) == len(prefix):
        return None
    return Path(uri[len(prefix):].split("?", 1)[0])
