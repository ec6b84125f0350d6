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


def pytest_collection_modifyitems(config, items):
    """Tests that launch go first: under pytest-xdist's ``loadfile`` the long files then start early, and the many
    quick ones fill the workers' time at the end instead of a long file starting last (a stable sort: each file's
    own order is kept)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
