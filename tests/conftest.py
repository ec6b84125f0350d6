"""Session-wide fixtures: the reused process groups (tests/helpers/pool.py) and one real ``mlflow server``."""

import os
import sys

import pytest

from tests.helpers import durations
from tests.helpers.mlflow_server import MlflowServer
from tests.helpers.pool import Pools


@pytest.fixture(scope="session")
def pools(tmp_path_factory):
    """``pools.run(target, *args, backend="gloo", nproc=2)``: a check body on reused workers (one pool per shape)."""
    started = Pools(tmp_path_factory.mktemp("pools"))
    yield started
    started.close()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server")).start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _mlflow_global_tracking_uri_restored():
    """``mlflow.set_tracking_uri`` (which some tests call, as the flavors' own calls read it) sets a process global and
    ``MLFLOW_TRACKING_URI`` in ``os.environ``, which every later launch from this pytest worker would inherit: under
    xdist the next file in the worker then searched another server's runs. Each test starts without it."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    tracking = sys.modules.get("mlflow.tracking._tracking_service.utils")
    if tracking is not None and tracking._tracking_uri is not None:
        tracking.set_tracking_uri(None)
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


def pytest_collection_modifyitems(config, items):
    """The longest files first (their seconds in ``tests/durations.json``; see tests/helpers/durations.py), then the
    other files that launch: under pytest-xdist's ``loadfile`` (run with ``--no-loadscope-reorder``, which keeps this
    order) a long file starting last would leave the other worker idle, while the many quick files fill both workers'
    time at the end. A stable sort: each file's own order is kept."""
    seconds = durations.load()
    items.sort(key=lambda item: (-seconds.get(item.nodeid.split("::")[0], 0), item.get_closest_marker("slow") is None))
