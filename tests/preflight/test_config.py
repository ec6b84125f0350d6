"""Bad combinations are refused by the CLI before any worker starts: exit 2, every key named, no traceback,
no process, no job directory left. (How fast that is, is measured in benchmarks/, not asserted here.)"""

import pytest

from tests.helpers.spawn import job_dirs, run_cli

CASES = [
    (["backend=nccl"], ["backend=nccl needs CUDA GPUs", "Use backend=gloo"]),
    (["offload=cpu", "wrap=fsdp2"], ["offload=cpu moves FSDP parameters", "Set offload=none"]),
    (["offload=cpu", "wrap=ddp"], ["offload=cpu only applies to FSDP, but wrap=ddp"]),
    (["precision=fp16"], ["precision=fp16 needs CUDA", "precision=bf16"]),
    (["wrap=dp"], ["wrap=dp is single-process DataParallel, but launcher.nproc_per_node=2"]),
    (["backend=horovod", "wrap=fsdp2"], ["wrap=fsdp2 cannot run under backend=horovod"]),
    (["backend=none", "launcher.nproc_per_node=2"], ["backend=none runs one process", "launcher.nproc_per_node=2", "launcher.nproc_per_node=1"]),
    (["model.sync_bn=true", "wrap=fsdp2"], ["sync_bn=true needs GPUs", "model.sync_bn=false"]),
    (["model.init_device=gpu"], ["model.init_device=gpu is not one of auto, meta, cpu", "model.init_device=auto"]),
    (["data.batch_size=63"], ["data.batch_size=63 is the global batch", "(63 / 2 = 31.5)", "data.batch_size=64"]),
    (["precision=bf16-true", "precision.init_scale=1024"], ["precision=bf16-true uses no grad scaler",
                                                            "precision.init_scale=1024.0"]),
    (["data.batch_size=0"], ["data.batch_size=0 is out of range", "Set data.batch_size to 1 or more"]),
    (["trainer.log_every=0"], ["trainer.log_every=0 is out of range"]),
    (["checkpoint.every_n_steps=-5"], ["checkpoint.every_n_steps=-5 is out of range", "0 or more"]),
    (["trainer.grad_clip=0"], ["trainer.grad_clip=0.0 must be greater than 0", "or null"]),
    (["launcher.nnodes=2"], ["launcher.rdzv_endpoint=HOST:PORT"]),
    (["wrap=zero3"], ["Could not find 'wrap/zero3'", "fsdp2", "python -m hydraddp --help"]),
    (["precision=fp8"], ["Could not find 'precision/fp8'", "bf16-true"]),
    (["trainer.max_stpes=3"], ["Key 'max_stpes' not in 'TrainerConfig'"]),
    (["launcher.nnodes=two"], ["Value 'two' of type 'str' could not be converted to Integer"]),
    (["launcher.nproc_per_node=two"], ["launcher.nproc_per_node=two is neither a number of processes nor auto",
                                       "Set launcher.nproc_per_node=N, or auto"]),
]


@pytest.mark.parametrize("overrides, expected", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_combination_is_refused_before_anything_starts(tmp_path, overrides, expected):
    done = run_cli(*overrides, cwd=tmp_path, timeout=60)  # the helper also checks that no process is left
    assert done.returncode == 2, done.stderr
    for text in expected:
        assert text in done.stderr
    assert "Traceback" not in done.stderr
    assert "[rank" not in done.stderr + done.stdout  # no worker ever logged
    assert job_dirs(tmp_path) == [] and not (tmp_path / "mlflow.db").exists()


def test_every_problem_is_listed_at_once(tmp_path):
    done = run_cli("backend=nccl", "precision=fp16", "data.batch_size=63", cwd=tmp_path, timeout=60)
    assert done.returncode == 2
    assert len([line for line in done.stderr.splitlines() if line.startswith("- ")]) == 3


def test_a_typed_nproc_per_node_that_srun_did_not_start_is_refused(tmp_path):
    # srun --ntasks-per-node=1 ... python -m hydraddp launcher.nproc_per_node=8 ran one process per node, warning once.
    srun_step = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                 "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NNODES": "2", "SLURM_NODEID": "0",
                 "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NODELIST": "127.0.0.1"}
    # Rank 0 of the step starts alone here: a refusing rank 0 waits for the others to hear of it (up to 15 s, or
    # launcher.timeout), and none comes.
    done = run_cli("launcher.nproc_per_node=8", "launcher.timeout=2", cwd=tmp_path, timeout=60, env=srun_step)
    assert done.returncode == 2, done.stderr
    assert "launcher.nproc_per_node=8, but slurm started 1 task(s) on this node" in done.stderr
    assert "srun --ntasks-per-node=8" in done.stderr and "Drop launcher.nproc_per_node" in done.stderr
    assert "Traceback" not in done.stderr and job_dirs(tmp_path) == []


def test_several_nodes_through_the_slurm_launcher_need_no_rendezvous_address(monkeypatch):
    """The README's multi-node Slurm command: its tasks attach to submitit's environment (the allocation's first node
    is the rendezvous), so the check before submission asks for no launcher.rdzv_endpoint. A local launch still does."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the slurm extra: pip install 'hydraddp[slurm]'")
    from hydraddp.clusters.submitit import SINGLE_JOB_ENV
    from hydraddp.config.compose import compose
    from hydraddp.preflight.config import problems
    from hydraddp.sweep import before_submission_problems

    readme = ["launcher.nnodes=2", "launcher.nproc_per_node=2", "backend=gloo", "wrap=fsdp2",
              "tracking.uri=http://mlflow:5000"]
    monkeypatch.setenv(SINGLE_JOB_ENV, "1")  # one launch (no -m), as clusters.submitit.prepare_argv marks it
    assert before_submission_problems(compose(["hydra/launcher=slurm", *readme], return_hydra_config=True)) == []
    local = [str(p) for p in problems(compose(readme))]
    assert any("launcher.nnodes=2 needs a rendezvous address every node can reach" in p for p in local), local
