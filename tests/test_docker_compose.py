"""docker-compose.yml, checked statically: it parses, its trainer commands are valid hydraddp command lines (composed
with Hydra), and its ports, hosts, URIs and drivers agree with each other and with MLflow's and SQLAlchemy's own rules.
scripts/compose_test.sh brings the stack up for real (in .ci/run, after this suite)."""

import re
import subprocess
from pathlib import Path
from string import Template

import yaml

from hydraddp.config.compose import compose

REPO = Path(__file__).resolve().parents[1]


def env_example() -> dict[str, str]:
    lines = (REPO / ".env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def compose_file() -> dict:
    text = (REPO / "docker-compose.yml").read_text()
    variables = set(re.findall(r"\$\{(\w+)", text))
    env = env_example()
    assert variables <= set(env), f"variables without a value in .env.example: {variables - set(env)}"
    return yaml.safe_load(Template(text).substitute(env))


def torchrun_flags(command: list[str]) -> tuple[dict[str, str], list[str]]:
    assert command[0] == "torchrun"
    split = command.index("-m")
    assert command[split + 1] == "hydraddp"
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in command[1:split])
    return flags, command[split + 2:]


def test_services_and_secrets():
    services = compose_file()["services"]
    assert set(services) == {"postgres", "mlflow", "trainer0", "trainer1"}
    raw = (REPO / "docker-compose.yml").read_text()
    assert "POSTGRES_PASSWORD: ${POSTGRES_PASSWORD}" in raw  # from .env, never written in the file
    assert ".env" in (REPO / ".gitignore").read_text().split()
    tracked = subprocess.run(["git", "ls-files", ".env"], cwd=REPO, capture_output=True, text=True).stdout
    assert tracked == ""


def test_mlflow_is_published_on_loopback_and_uses_postgres_and_a_volume():
    services = compose_file()["services"]
    mlflow = services["mlflow"]
    assert all(port.startswith("127.0.0.1:") for port in mlflow["ports"])
    command = mlflow["command"]
    backend = command[command.index("--backend-store-uri") + 1]
    env = env_example()
    assert backend == f"postgresql+psycopg2://{env['POSTGRES_USER']}:{env['POSTGRES_PASSWORD']}@postgres:5432/{env['POSTGRES_DB']}"
    assert command[command.index("--artifacts-destination") + 1] == "/mlartifacts"
    assert "mlartifacts:/mlartifacts" in mlflow["volumes"]
    container_port = command[command.index("--port") + 1]
    assert mlflow["ports"] == [f"127.0.0.1:{env['MLFLOW_PORT']}:{container_port}"]


def test_trainers_are_one_two_node_rendezvous_of_valid_hydraddp_commands():
    services = compose_file()["services"]
    mlflow_port = services["mlflow"]["command"][services["mlflow"]["command"].index("--port") + 1]
    flags = {}
    for name in ("trainer0", "trainer1"):
        flags[name], overrides = torchrun_flags(services[name]["command"])
        cfg = compose(overrides)  # raises if an override is not valid hydraddp config
        assert cfg.tracking.uri == f"http://mlflow:{mlflow_port}"
        assert services[name]["depends_on"]["mlflow"]["condition"] == "service_healthy"
    assert {f["node_rank"] for f in flags.values()} == {"0", "1"}
    assert all(f["nnodes"] == "2" and f["rdzv_backend"] == "c10d" for f in flags.values())
    endpoints = {f["rdzv_endpoint"] for f in flags.values()}
    assert len(endpoints) == 1
    host, port = endpoints.pop().split(":")
    host_node = next(n for n, f in flags.items() if f["node_rank"] == "0")
    assert services[host_node]["hostname"] == host and port.isdigit()
    assert flags["trainer0"]["rdzv_id"] == flags["trainer1"]["rdzv_id"]


def test_the_image_installs_the_project():
    dockerfile = (REPO / "Dockerfile").read_text()
    assert 'ARG TORCH_SPEC="torch==2.13.0"' in dockerfile
    for path in ("hydraddp", "conf", "experiments"):
        assert f"COPY {path} ./{path}" in dockerfile


# What SQLAlchemy's dialect loads for a backend store URI, and the pip requirement that installs it.
DRIVER_REQUIREMENTS = {"psycopg2": "psycopg2-binary", "psycopg": "psycopg[binary]"}


def test_the_image_installs_the_driver_the_backend_store_uri_loads():
    """A bare postgresql:// is psycopg 3 under SQLAlchemy 2.1: the server exited 1 on an image with psycopg2 alone."""
    from sqlalchemy.engine import make_url

    command = compose_file()["services"]["mlflow"]["command"]
    driver = make_url(command[command.index("--backend-store-uri") + 1]).get_dialect().driver
    install = next(line for line in (REPO / "Dockerfile").read_text().splitlines() if " . " in line and "pip" in line)
    assert DRIVER_REQUIREMENTS[driver] in install.split(), (driver, install)


def test_the_server_accepts_the_host_names_its_clients_use():
    """MLflow 3 refuses (403) a Host header that is not localhost or a private address unless --allowed-hosts names
    it: the trainers reach the server as mlflow:PORT, the user's browser as 127.0.0.1:MLFLOW_PORT."""
    from urllib.parse import urlsplit

    from mlflow.server.security import get_default_allowed_hosts
    from mlflow.server.security_utils import is_allowed_host_header

    services, env = compose_file()["services"], env_example()
    command = services["mlflow"]["command"]
    allowed = (command[command.index("--allowed-hosts") + 1].split(",") if "--allowed-hosts" in command
               else get_default_allowed_hosts())
    clients = {urlsplit(compose(torchrun_flags(services[t]["command"])[1]).tracking.uri).netloc
               for t in ("trainer0", "trainer1")}
    for host in (*clients, f"127.0.0.1:{env['MLFLOW_PORT']}", f"localhost:{env['MLFLOW_PORT']}"):
        assert is_allowed_host_header(allowed, host), (host, allowed)
