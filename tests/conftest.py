"""Session-wide fixtures: the reused process groups (tests/helpers/pool.py) and one real ``mlflow server``."""

import pytest

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
