"""Every node in the launch's one run, against a real `mlflow server`: a 2-node loopback launch (2 x 2 ranks, each node
its own launcher in its own directory) holds both nodes' system metrics under distinct names and both nodes' logs;
the run has a readable name, never an override's value, and MLflow's own source tags of the user's working tree."""

import re
import subprocess
import sys
import uuid

import pytest

from hydraddp.tracking import names
from tests.helpers.spawn import NO_PLAN, rendezvous_port, run_together
from tests.tracking.test_mlflow import QUICK, runs_of, tracked

pytestmark = pytest.mark.slow  # launches for real: see docs/development/tests.md

SECRET = "hunter2-do-not-show"


def git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def two_node_run(mlflow_server, tmp_path_factory):
    root, experiment, endpoint = tmp_path_factory.mktemp("nodes"), f"nodes-{uuid.uuid4().hex[:6]}", f"127.0.0.1:{rendezvous_port()}"
    for node in (0, 1):
        (root / f"node{node}").mkdir()
    # Node 0 launches from the user's own git working tree, with a change not committed yet.
    git(root / "node0", "init", "-q")
    (root / "node0" / "train_notes.md").write_text("first\n")
    git(root / "node0", "add", ".")
    git(root / "node0", "-c", "user.name=u", "-c", "user.email=u@e", "commit", "-q", "-m", "first")
    git(root / "node0", "remote", "add", "origin", f"https://someone:{SECRET}@example.com/team/project.git")
    (root / "node0" / "train_notes.md").write_text("changed\n")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root / "node0", capture_output=True, text=True).stdout
    nodes = run_together([([sys.executable, "-m", "hydraddp", "launcher.nnodes=2", f"launcher.node_rank={node}",
                            "launcher.nproc_per_node=2", f"launcher.rdzv_endpoint={endpoint}", "wrap=fsdp2",
                            "tracking.system_metrics.interval_s=1", f"+tracking.tags.api_token={SECRET}",
                            "data.batch_size=64", *QUICK, NO_PLAN, *tracked(mlflow_server, experiment)],
                           root / f"node{node}") for node in (0, 1)], timeout=300)
    assert [n.returncode for n in nodes] == [0, 0], [n.stderr[-3000:] for n in nodes]
    # Node 1's process found the run (a launch that ended within one poll of its node file once lost it).
    assert "hydraddp: node 1:" not in nodes[1].stderr, nodes[1].stderr[-3000:]
    [run] = runs_of(mlflow_server, experiment)
    return run, commit.strip()


def test_both_nodes_system_metrics_are_in_the_one_run(mlflow_server, two_node_run):
    run, _ = two_node_run
    keys = set(run.data.metrics)
    for node in ("node0", "node1"):
        assert {f"system/{node}/cpu_utilization_percentage", f"system/{node}/system_memory_usage_megabytes"} <= keys, \
            sorted(k for k in keys if k.startswith("system/"))
    assert not any(re.fullmatch(r"system/[^/]+", k) for k in keys)  # every system metric names its node


def test_both_nodes_logs_are_uploaded_each_under_its_node(mlflow_server, two_node_run):
    run, _ = two_node_run
    client = mlflow_server.client()
    assert {a.path for a in client.list_artifacts(run.info.run_id, "logs")} == {"logs/node0", "logs/node1"}
    uploaded = {a.path for node in (0, 1) for a in client.list_artifacts(run.info.run_id, f"logs/node{node}")}
    # Each rank's log once, under the node it ran on (a node's ranks are contiguous: its local ranks).
    assert len(uploaded) == 4 and {p.rsplit("/", 1)[1] for p in uploaded} == {f"rank{r}.log" for r in range(4)}
    for node in (0, 1):
        ranks = sorted(int(p[-5]) for p in uploaded if p.startswith(f"logs/node{node}/"))
        assert ranks in ([0, 1], [2, 3]), (node, ranks)
    path = client.download_artifacts(run.info.run_id, next(p for p in uploaded if p.startswith("logs/node1/")))
    assert "step 12 loss" in open(path).read()


def test_the_run_name_follows_the_template_and_hides_every_value(two_node_run):
    run, _ = two_node_run
    # {experiment}-{wrap}-{precision}-w{world}-{id}: no experiment= here, so that field drops out.
    assert run.info.run_name == f"fsdp2-fp32-w4-{run.info.run_id[:4]}"
    assert SECRET not in run.info.run_name and "127.0.0.1" not in run.info.run_name


def test_the_source_tags_name_the_users_commit_dirty_tree_and_entry_point(two_node_run):
    run, commit = two_node_run
    tags = run.data.tags
    assert tags["mlflow.source.git.commit"] == commit and tags["mlflow.source.git.dirty"] == "true"
    assert tags["mlflow.source.git.repoURL"] == "https://example.com/team/project.git"  # no credentials
    assert tags["mlflow.source.name"] == tags["mlflow.project.entryPoint"] == "python -m hydraddp"
    assert tags["mlflow.source.type"] == "LOCAL" and tags["mlflow.user"]
    assert SECRET not in " ".join(tags.values())
    assert tags[names.TAG_WORLD_SIZE] == "4"


def test_under_torchrun_on_two_hosts_both_nodes_system_metrics_and_logs_reach_the_run(mlflow_server, tmp_path):
    """As docker-compose.yml runs it: one torchrun per host, no launcher of ours. Node 1's local rank 0 keeps its
    node's part (it once had none: only system/node0/* reached the run)."""
    experiment, endpoint = f"torchrun-nodes-{uuid.uuid4().hex[:6]}", f"127.0.0.1:{rendezvous_port()}"
    for node in (0, 1):
        (tmp_path / f"host{node}").mkdir()
    nodes = run_together([([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                            f"--node_rank={node}", "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}",
                            f"--rdzv_id={experiment}", "-m", "hydraddp", "backend=gloo", "wrap=fsdp2",
                            "tracking.system_metrics.interval_s=1", *QUICK, NO_PLAN, *tracked(mlflow_server, experiment)],
                           tmp_path / f"host{node}") for node in (0, 1)], timeout=300)
    assert [n.returncode for n in nodes] == [0, 0], [n.stderr[-3000:] for n in nodes]
    [run] = runs_of(mlflow_server, experiment)
    assert run.info.status == "FINISHED" and run.data.tags[names.TAG_WORLD_SIZE] == "2"
    for node in ("node0", "node1"):
        assert f"system/{node}/cpu_utilization_percentage" in run.data.metrics, \
            sorted(k for k in run.data.metrics if k.startswith("system/"))
    client = mlflow_server.client()
    assert [a.path for a in client.list_artifacts(run.info.run_id, "logs/node1")] == ["logs/node1/rank1.log"]
    assert list((tmp_path / "host1").iterdir()) == []  # node 1 composed in the user's directory: nothing written there


def test_a_template_with_an_unknown_field_exits_2_naming_it(tmp_path):
    done = subprocess.run([sys.executable, "-m", "hydraddp", 'tracking.run_name="{wrap}-{branch}"'], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "tracking.run_name='{wrap}-{branch}' uses {branch}, which is not a field of a run name" in done.stderr
    assert not list(tmp_path.glob("outputs/*/*"))
