"""python -m hydraddp end to end: real 2-process trainings, one job directory each, torchrun attach,
two nodes on loopback, sweeps, Hydra's own flags, and the contract's exit codes."""

import json
import re
import sys

import pytest
import yaml

from hydraddp.distributed.env import free_port
from tests.helpers.spawn import (NO_PLAN, REPO, UNTRACKED, interrupt_when, job_dirs, rendezvous_port, run_cli,
                                 run_process, run_together)

pytestmark = pytest.mark.slow  # launches for real: see docs/development/tests.md

QUICK = ["trainer.max_steps=12", "trainer.log_every=4", "trainer.eval_every=0", NO_PLAN]
UNTRACKED_QUICK = [*QUICK, UNTRACKED]  # for what the tracker is no part of; the sweep below is tracked
DONE = re.compile(r"hydraddp: done\. (\d+) steps at world size (\d+): loss ([\d.]+)")


def finished(output: str) -> tuple[int, int, float]:
    match = DONE.search(output)
    assert match, output[-3000:]
    return int(match[1]), int(match[2]), float(match[3])


WRAPS, PRECISIONS = ("ddp", "fsdp", "fsdp2"), ("fp32", "bf16")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One multirun of every wrap x precision, tracked as a launch is by default: six trainings of two processes
    each, a job directory each, and the sweep's summary (one launcher, not six)."""
    root = tmp_path_factory.mktemp("sweep")
    done = run_cli("-m", f"wrap={','.join(WRAPS)}", f"precision={','.join(PRECISIONS)}", *QUICK, cwd=root, timeout=800)
    assert done.returncode == 0, done.stderr[-4000:]
    jobs = {}
    for job in sorted(root.glob("multirun/*/*/*/.hydra")):
        saved = yaml.safe_load((job / "config.yaml").read_text())
        jobs[saved["wrap"]["name"], saved["precision"]["name"]] = job.parent
    return done, jobs


@pytest.mark.timeout(900)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("wrap", WRAPS)
def test_two_process_training_leaves_one_job_directory(sweep, wrap, precision):
    done, jobs = sweep
    job = jobs[wrap, precision]
    assert sorted(p.name for p in (job / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    rank1_log = (job / "logs" / "rank1.log").read_text()
    assert f"auto_model: wrap={wrap} precision={precision}" in rank1_log
    # Every rank fixes glibc's thresholds before it builds anything (hydraddp.train.host_heap).
    assert "glibc malloc: mmap threshold 32 MiB, trim threshold 64 MiB" in rank1_log
    result = json.loads((job / "result.json").read_text())  # rank 0's result, as its done line says
    assert (result["steps"], result["world_size"]) == (12, 2)
    assert result["final_loss"] < 2.3  # log(10) = 2.30 is where an untrained classifier starts
    assert f"12 steps at world size 2: loss {result['final_loss']:.4f}" in done.stdout
    assert len(result["reports"]) == 2 and result["reports"][0]["wrapper"] == wrap
    # model.init_device=auto: built on the meta device and filled after sharding under the FSDPs, whole otherwise.
    assert [r["init_device"] for r in result["reports"]] == ["meta" if wrap in ("fsdp", "fsdp2") else "cpu"] * 2
    # Throughput is the global batch over the step time (of the last logging window), not any positive number.
    batch = yaml.safe_load((job / ".hydra" / "config.yaml").read_text())["data"]["batch_size"]
    assert result["samples_per_s"] == pytest.approx(batch / result["step_time_s"], rel=1e-6)
    assert result["steady_samples_per_s"] > 0 and len(result["peak_memory_bytes"]) == 2
    assert len(result["build_peak_memory_bytes"]) == 2
    mesh = {"ddp": "dp_replicate=2,dp_shard=1,tp=1", "fsdp2": "dp_replicate=1,dp_shard=2,tp=1"}.get(wrap)
    assert [r["mesh"] for r in result["reports"]] == [mesh] * 2


@pytest.mark.timeout(900)
def test_a_multirun_completes_every_job_with_a_summary(sweep):
    done, jobs = sweep
    assert sorted(jobs) == sorted((w, p) for w in WRAPS for p in PRECISIONS)
    assert done.stdout.count("hydraddp: done.") == len(jobs)
    table = done.stdout.split("hydraddp sweep summary", 1)[1]
    assert len(re.findall(r"^\s*\d+\s+ok\s", table, re.M)) == len(jobs)
    # Each job's tracker created its run, a child of the sweep's (a tracker forked from the sweep's process, which
    # had MLflow's connections, once never did: the jobs still said "ok").
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{next(iter(jobs.values())).parents[3] / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("hydraddp").experiment_id])
    [parent] = [run for run in runs if "mlflow.parentRunId" not in run.data.tags]
    children = [run for run in runs if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(run.data.tags["hydraddp.job_dir"] for run in children) == sorted(str(job) for job in jobs.values())
    assert {run.info.status for run in children} == {"FINISHED"}


def test_the_same_seed_gives_the_same_training(tmp_path):
    losses = [finished(run_cli(*UNTRACKED_QUICK, "trainer.seed=3", cwd=tmp_path / str(i)).stdout)[2] for i in range(2)]
    assert losses[0] == losses[1]


def test_gpt_experiment_shards_its_blocks_and_says_its_mfu(tmp_path):
    done = run_cli("experiment=gpt_fsdp2", "trainer.max_steps=4", "trainer.eval_every=0", "model.depth=2", NO_PLAN, UNTRACKED,
                   "trainer.log_every=2", "trainer.peak_tflops=0.5", cwd=tmp_path)  # a peak given: MFU on any device
    assert done.returncode == 0, done.stderr[-4000:]
    [job] = job_dirs(tmp_path)
    assert "auto_model: wrap=fsdp2 precision=bf16" in (job / "logs" / "rank0.log").read_text()
    mfu = re.search(r"samples/s at ([\d.]+)% MFU\. Job directory", done.stdout)
    assert mfu and 0 < float(mfu[1]), done.stdout


def test_under_torchrun_it_attaches_with_one_job_directory_and_every_rank_resumes_latest_there(tmp_path):
    def torchrun(*overrides: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                "-m", "hydraddp", "hydra.run.dir=job", *UNTRACKED_QUICK, *overrides]

    done = run_process(torchrun("checkpoint.every_n_steps=6"), cwd=tmp_path, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    assert finished(done.stdout)[:2] == (12, 2)
    assert done.stdout.count("hydraddp: done.") == 1  # one report, from rank 0
    job = tmp_path / "job"
    assert [p.name for p in tmp_path.iterdir()] == ["job"]  # the other rank wrote no directory of its own
    assert sorted(p.name for p in (job / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    # checkpoint.resume=latest with the default checkpoint.dir: the ranks other than 0 compose in ".", yet every
    # rank resumes the agreed job directory's latest checkpoint (they once looked in ./checkpoints and exited 2).
    resumed = run_process(torchrun("checkpoint.resume=latest", "trainer.max_steps=18"), cwd=tmp_path, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert finished(resumed.stdout)[:2] == (18, 2)
    for rank in (0, 1):
        assert f"resumed from {job / 'checkpoints' / 'step_00000012'} at step 12" in (job / "logs" / f"rank{rank}.log").read_text()


def test_under_torchrun_a_worker_that_fails_exits_1_with_its_error_not_as_an_invalid_config(tmp_path):
    done = run_process([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
                        f"--master_port={free_port()}", "-m", "hydraddp", "hydra.run.dir=job", *QUICK,
                        "task._target_=tests.train.user_task.RaisesAt", "task.step=2"], cwd=tmp_path, timeout=180)
    assert done.returncode == 1, done.stderr[-3000:]  # torchrun passes on its worker's exit code
    assert "hydraddp: rank 0 failed: RuntimeError: the user's task failed at step 2" in done.stderr
    assert "invalid configuration" not in done.stderr
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("hydraddp").experiment_id])
    assert run.info.status == "FAILED"


def test_two_nodes_on_loopback_train_as_one_world(tmp_path):
    """Node 1 starts first: its agent has the lower pid, and torch's rendezvous (which orders nodes by host and pid,
    not by node_rank) gives its worker global rank 0. The launch's roles still follow node 0's job directory, the one
    both nodes agreed on: the result, the done line and the retired preemption marker are there."""
    endpoint = f"127.0.0.1:{rendezvous_port()}"
    agreed = tmp_path / "node0" / "job"
    # A stale marker in the agreed directory (as after an earlier preempted launch that has since finished): a
    # launch that ends there retires it, so that a rerun starts afresh.
    agreed.mkdir(parents=True)
    (agreed / "preempted.json").write_text(json.dumps([{"step": 0, "checkpoint": None, "signal": "SIGTERM"}]))
    (tmp_path / "node1").mkdir()
    nodes = run_together([([sys.executable, "-m", "hydraddp", "launcher.nnodes=2", f"launcher.node_rank={rank}",
                            "launcher.nproc_per_node=1", f"launcher.rdzv_endpoint={endpoint}", "hydra.run.dir=job",
                            *UNTRACKED_QUICK], tmp_path / f"node{rank}") for rank in (1, 0)])
    node1, node0 = nodes
    assert [node0.returncode, node1.returncode] == [0, 0], [node.stderr[-3000:] for node in nodes]
    node_files = {rank: json.loads((tmp_path / f"node{rank}" / "job" / "node.json").read_text()) for rank in (0, 1)}
    assert node_files[1]["ranks"] == [0] and node_files[0]["ranks"] == [1], node_files  # global rank 0 on node 1
    # One training of world size 2, in one job directory: node 0's, where both ranks logged the same losses.
    assert finished(node0.stdout)[:2] == (12, 2) and "hydraddp: done." not in node1.stdout
    assert json.loads((agreed / "result.json").read_text())["world_size"] == 2
    assert not (tmp_path / "node1" / "job" / "result.json").exists() and not (agreed / "preempted.json").exists()
    logs = list((agreed / "logs").glob("rank*.log"))
    assert sorted(log.name for log in logs) == ["rank0.log", "rank1.log"]
    losses = [re.findall(r"step 12 loss ([\d.]+)", log.read_text()) for log in logs]
    assert losses[0] == losses[1] != []


def test_a_broken_job_does_not_stop_the_sweep(tmp_path):
    # Job 1 is invalid (63 does not split over 2 ranks); job 2's worker raises (a negative learning rate).
    done = run_cli("-m", "data.batch_size=64,63", "optim.optimizer.lr=0.003,-1", *UNTRACKED_QUICK, cwd=tmp_path, timeout=300)
    assert done.returncode == 1
    table = done.stdout.split("hydraddp sweep summary", 1)[1]
    statuses = re.findall(r"^\s*\d+\s+(\w+)\s", table, re.M)
    assert statuses == ["ok", "failed", "invalid", "invalid"]
    assert re.search(r"rank \d failed: ValueError: Invalid learning rate: -1", table)


def test_cfg_job_prints_the_composed_config(tmp_path):
    done = run_cli("wrap=fsdp2", "precision=bf16", "--cfg", "job", cwd=tmp_path, timeout=60)
    assert done.returncode == 0
    printed = yaml.safe_load(done.stdout)
    assert (printed["wrap"]["name"], printed["precision"]["name"], printed["launcher"]["nproc_per_node"]) == \
        ("fsdp2", "bf16", "auto")  # as composed: the launch decides auto (one per GPU under nccl, else 2)
    assert job_dirs(tmp_path) == []


def test_help_lists_every_group_and_its_options(tmp_path):
    done = run_cli("--help", cwd=tmp_path, timeout=60)
    assert done.returncode == 0
    assert "wrap: auto, ddp, dp, fsdp, fsdp2, none" in done.stdout
    assert "precision: bf16, bf16-true, fp16, fp32" in done.stdout
    assert "backend: auto, gloo, horovod, mpi, nccl, none" in done.stdout
    assert "offload: cpu, none" in done.stdout
    assert "task: causal_lm, classification" in done.stdout
    assert "experiment: fastest_fit, gpt_fsdp2, quick, wrap_sweep" in done.stdout


def test_a_failing_worker_exits_1_with_one_short_block(tmp_path):
    done = run_cli("optim.optimizer.lr=-1", *UNTRACKED_QUICK, cwd=tmp_path)
    assert done.returncode == 1
    rank = re.search(r"hydraddp: rank (\d) failed: ValueError: Invalid learning rate: -1", done.stderr)[1]
    # One block: the rank and error, the last frames, where the whole traceback is. Not two full tracebacks.
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) <= 10, done.stderr
    assert re.search(r"adam\.py:\d+ in __init__: raise ValueError", done.stderr)
    [job] = job_dirs(tmp_path)
    assert f"full traceback: {job / 'logs' / f'rank{rank}.log'}" in done.stderr
    assert "Traceback (most recent call last)" in (job / "logs" / f"rank{rank}.log").read_text()


def test_ctrl_c_stops_every_worker_and_exits_130(tmp_path):
    def training():
        logs = list(tmp_path.glob("outputs/*/*/logs/rank1.log"))
        return bool(logs) and "step 1 " in logs[0].read_text()

    done = interrupt_when([sys.executable, "-m", "hydraddp", "trainer.max_steps=100000", "trainer.log_every=1", UNTRACKED],
                          ready=training, cwd=tmp_path)
    assert done.returncode == 130, done.stderr[-3000:]
    assert "interrupted; every worker was stopped" in done.stderr
    # The interrupted ranks stop themselves instead of unwinding: unwinding a step cut short once deadlocked DDP's
    # reducer against gloo's thread until the agent's 30 s grace ran out (about one Ctrl-C in four). A rank caught
    # inside an all-reduce may see its peer leave first and end on gloo's "connection closed" error instead.
    logs = {rank: next(tmp_path.glob(f"outputs/*/*/logs/rank{rank}.log")).read_text() for rank in (0, 1)}
    assert any(f"rank {rank} stopped: interrupted" in log for rank, log in logs.items()), logs


def test_inside_a_slurm_allocation_but_not_an_srun_step_it_launches_locally(tmp_path):
    # An salloc shell or sbatch script: SLURM_PROCID/SLURM_NTASKS are set, but no srun step started 4 ranks.
    done = run_cli(*UNTRACKED_QUICK, cwd=tmp_path, timeout=120,
                   env={"SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"})
    assert done.returncode == 0, done.stderr[-4000:]
    assert finished(done.stdout)[:2] == (12, 2)  # launcher.nproc_per_node=2, not the allocation's 4 tasks
    assert "in Slurm job 4242 but not in an srun step: launching 2 local worker(s)" in done.stderr


def test_a_launch_resolves_its_config_once_and_the_cli_keeps_no_module_state(tmp_path):
    """compose -> validate everything -> resolve once into a frozen Job -> launch: the tracker and every worker
    read that one plan (counted in the launching process, the only one that may resolve)."""
    import os as _os
    import textwrap

    from hydraddp import cli

    script = tmp_path / "count.py"
    script.write_text(textwrap.dedent("""
        import atexit, os, sys
        import hydraddp.job as job_module
        calls, original, me = [], job_module.resolve, os.getpid()
        def counted(cfg):
            calls.append(os.getpid())
            return original(cfg)
        job_module.resolve = counted
        atexit.register(lambda: os.getpid() == me and print(f"resolved {len(calls)} time(s)", file=sys.stderr))
        import runpy
        runpy.run_module("hydraddp", run_name="__main__", alter_sys=True)  # as python -m hydraddp
    """))
    done = run_process([sys.executable, str(script), "trainer.max_steps=5", f"tracking.uri=sqlite:///{tmp_path}/m.db"],
                       cwd=tmp_path, env={"PYTHONPATH": _os.pathsep.join([str(tmp_path), str(REPO)])})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resolved 1 time(s)" in done.stderr
    mutable = [name for name, value in vars(cli).items() if isinstance(value, (dict, list, set, bytearray))
               and not name.startswith("__")]
    assert mutable == []
