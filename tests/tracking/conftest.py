import pytest

from tests.helpers.mlflow_server import MlflowServer


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server")).start()
    yield server
    server.stop()
