"""One launch, one place: every rank of a launch, on every node and across restarts, writes into one job
directory and one checkpoint root, and resumes from it (real processes on loopback, real torchrun)."""

import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from hydraddp.distributed.env import free_port
from tests.helpers.spawn import (assert_no_orphans, child_env, job_dirs, rendezvous_port, run_process, run_together,
                                 sigkill_rank_when_logged, wait_for_published_checkpoint)
from tests.train.test_checkpoint import export, losses, max_diff

pytestmark = pytest.mark.slow  # launches for real: see docs/development/tests.md

BASE = ["optim=sgd", "trainer.log_every=1", "trainer.eval_every=0", "tracking.enabled=false"]


def two_nodes(tmp_path: Path, where: str, *overrides: str, per_node: dict[int, list[str]] | None = None):
    """2 nodes x 2 ranks on loopback, each node in its own working directory."""
    endpoint = f"127.0.0.1:{rendezvous_port()}"
    commands = []
    for node in (0, 1):
        cwd = tmp_path / where / f"node{node}"
        cwd.mkdir(parents=True)
        commands.append(([sys.executable, "-m", "hydraddp", "launcher.nnodes=2", f"launcher.node_rank={node}",
                          "launcher.nproc_per_node=2", f"launcher.rdzv_endpoint={endpoint}", *BASE, *overrides,
                          *(per_node or {}).get(node, [])], cwd))
    return run_together(commands, timeout=240)


def test_two_nodes_write_one_checkpoint_and_resume_from_it(tmp_path):
    shared = tmp_path / "shared"
    first = two_nodes(tmp_path, "first", "trainer.max_steps=10", "checkpoint.every_n_steps=5",
                      f"checkpoint.dir={shared}")
    assert [n.returncode for n in first] == [0, 0], [n.stderr[-3000:] for n in first]
    assert sorted(p.name for p in shared.iterdir()) == ["step_00000005", "step_00000010"]
    step10 = shared / "step_00000010"
    # Every one of the 4 ranks wrote into it: its DCP shard and its RNG states.
    assert sorted(p.name for p in step10.glob("rng_rank*.json")) == [f"rng_rank{r}.json" for r in range(4)]
    assert len(list(step10.glob("*.distcp"))) == 4
    # The nodes' launchers made their own directories; the ranks all logged into node 0's.
    logs = [log.name for node in (0, 1) for job in job_dirs(tmp_path / "first" / f"node{node}")
            for log in (job / "logs").glob("rank*.log")]
    assert sorted(logs) == [f"rank{r}.log" for r in range(4)]

    resumed = two_nodes(tmp_path, "resumed", "trainer.max_steps=14", "checkpoint.resume=latest",
                        f"checkpoint.dir={shared}", "checkpoint.save_last=true")
    assert [n.returncode for n in resumed] == [0, 0], [n.stderr[-3000:] for n in resumed]
    [job] = job_dirs(tmp_path / "resumed" / "node0")
    assert min(losses(job)) == 11 and (shared / "step_00000014").is_dir()


def test_a_checkpoint_root_that_not_every_node_sees_is_refused_before_training(tmp_path):
    # Each node points checkpoint.dir at a disk of its own, as a node-local path on a cluster would.
    nodes = two_nodes(tmp_path, "local", "trainer.max_steps=10", "checkpoint.every_n_steps=5",
                      per_node={node: [f"checkpoint.dir={tmp_path / f'disk{node}'}"] for node in (0, 1)})
    for node in nodes:
        assert node.returncode == 2, node.stderr[-3000:]
        assert "is not shared by every node" in node.stderr and "Set checkpoint.dir to a path on storage" in node.stderr
        assert "Traceback" not in node.stderr
    for node in (0, 1):
        for job in job_dirs(tmp_path / "local" / f"node{node}"):
            assert not re.search(r"step \d+ loss", "".join(p.read_text() for p in (job / "logs").glob("*.log")))
        assert not list((tmp_path / f"disk{node}").glob("step_*"))


def test_rank_0_knows_a_restart_by_the_attempts_the_agent_counts_whatever_directory_it_composed(tmp_path,
                                                                                                 monkeypatch):
    """The agent's store (here a real TCPStore, as torchrun's) counts each attempt's rank 0: a restart into a fixed
    hydra.run.dir, which composes the first attempt's directory again, is a restart too, and the agreed directory is
    never removed; a directory composed elsewhere is given up for the agreed one. (The launches below, and
    test_elastic's, show the rest: one MLflow run, every step once.)"""
    from torch.distributed import TCPStore

    from hydraddp.job import job_dir_after_restart
    from hydraddp.tracking import names

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "true")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "job1"}.items():
        monkeypatch.setenv(key, value)
    fixed, composed = tmp_path / "runs" / "job1", tmp_path / "outputs" / "later"
    removed = []
    assert job_dir_after_restart(fixed, removed.append) == (fixed, False)  # the first attempt
    assert job_dir_after_restart(fixed, removed.append) == (fixed, True)  # a restart into the same fixed directory
    assert job_dir_after_restart(composed, removed.append) == (fixed, True)  # a restart that composed another one
    assert removed == [composed]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job2")  # another launch on the same store starts afresh
    assert job_dir_after_restart(composed, removed.append) == (composed, False)
    # A restart whose store is new (the lost node's agent kept the old one): known by torch's restart count and, in
    # a fixed directory, the first attempt's run; a directory composed anew has none to go on with.
    fixed.mkdir(parents=True)
    (fixed / names.RUN_ID_FILE).write_text("abc")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job3")
    assert job_dir_after_restart(fixed, removed.append) == (fixed, True)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job4")
    assert job_dir_after_restart(composed, removed.append) == (composed, False)
    monkeypatch.setenv("RANK", "1")  # only rank 0 asks
    assert job_dir_after_restart(fixed, removed.append) == (fixed, False) and removed == [composed]


RESTARTED = [*BASE[:-1], "trainer.max_steps=120", "checkpoint.every_n_steps=20", "checkpoint.save_last=true",
             "model.hidden=[512,512]"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference of the restart tests: the same training under torchrun, never killed (its step-120 weights)."""
    root = tmp_path_factory.mktemp("full")
    full = run_process([*TORCHRUN, f"--master_port={free_port()}", "-m", "hydraddp", *RESTARTED,
                        "tracking.enabled=false"], cwd=root, timeout=300)
    assert full.returncode == 0, full.stderr[-3000:]
    [full_job] = job_dirs(root)
    return export(full_job / "checkpoints" / "step_00000120", root / "full.pt")


# Hydra's own directory, or a fixed one as on a cluster (hydra.run.dir=/shared/runs/${oc.env:SLURM_JOB_ID}), where
# the restarted rank 0 composes the first attempt's directory again (under outputs/ for the helpers' globs).
@pytest.mark.parametrize("run_dir", [None, "outputs/runs/job1"], ids=["composed", "fixed"])
def test_a_sigkilled_rank_under_torchrun_restarts_from_the_launchs_checkpoint(tmp_path, uninterrupted, run_dir):
    killed = tmp_path / "killed"
    killed.mkdir()
    token = uuid.uuid4().hex
    fixed = [f"hydra.run.dir={killed / run_dir}"] if run_dir else []
    proc = subprocess.Popen([*TORCHRUN, "--max-restarts=1", f"--master_port={free_port()}", "-m", "hydraddp",
                             *RESTARTED, *fixed], cwd=killed, env=child_env(token), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for_published_checkpoint(proc, killed, 20, timeout=180)
        sigkill_rank_when_logged(proc, killed, r"step (2[1-9]|[3-9]\d) loss")
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-4000:]
    assert_no_orphans(token)
    [job] = job_dirs(killed)  # the restarted group went on in the first attempt's directory
    assert run_dir is None or job == killed / run_dir
    assert "restarted from" in (job / "logs" / "rank0.log").read_text()
    recovered = export(job / "checkpoints" / "step_00000120", tmp_path / "recovered.pt")
    assert max_diff(uninterrupted, recovered) <= 1e-6

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{killed / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("hydraddp").experiment_id])
    assert len(runs) == 1, [(r.info.run_name, r.info.status) for r in runs]  # one run, both attempts
    [run] = runs
    assert run.info.status == "FINISHED" and run.data.tags["hydraddp.restarts"] == "1"
    assert run.data.tags["hydraddp.job_dir"] == str(job)
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == list(range(1, 121))
