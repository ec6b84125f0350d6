"""Pipeline parallel through the command (issue 56): ``python -m hydraddp mesh.pp=2`` on real gloo ranks, with every
default on (tracking, the logged model, checkpoints, evaluation) and gradient clipping, trains as one process does,
under wrap=none and with each stage sharded by FSDP2, split by TP, replicated by HSDP, and all at once (pp=2 x
dp_shard=2 x tp=2, 8 ranks); stopped and resumed, it ends where the uninterrupted launch does; and what it cannot
run yet is refused before any process starts, saying why."""

from __future__ import annotations

import json

import pytest

from tests.helpers.spawn import job_dirs, run_cli

SAME = ["model=gpt", "data=text", "task=causal_lm", "model.depth=4", "model.dim=32", "model.heads=2",
        "data.dataset.num_chars=4000", "data.batch_size=8", "trainer.log_every=1", "trainer.eval_every=4",
        "trainer.grad_clip=0.5", "backend=gloo"]


def _result(job) -> dict:
    return json.loads((job / "result.json").read_text())


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """What every pipelined launch here is compared with: the same training in one process, unwrapped."""
    cwd = tmp_path_factory.mktemp("alone")
    alone = run_cli(*SAME, "wrap=none", "trainer.max_steps=8", "launcher.nproc_per_node=1", "tracking.enabled=false",
                    cwd=cwd)
    assert alone.returncode == 0, alone.stderr[-4000:]
    [one] = job_dirs(cwd)
    return _result(one)


# Each mesh's ranks in order: their coordinates ([pp, dp_replicate, dp_shard, tp]) and their stage's FSDP2 units.
FIRST, SECOND = ["<root>", "blocks.0", "blocks.1"], ["<root>", "blocks.2", "blocks.3"]
MESHES = {
    "pp2-none": (["wrap=none", "mesh.pp=2"], 2, None, None),
    "pp2xdp2-fsdp2": (["wrap=fsdp2", "mesh.pp=2", "mesh.dp_shard=2"], 4,
                      [[0, 0, 0, 0], [0, 0, 1, 0], [1, 0, 0, 0], [1, 0, 1, 0]], [FIRST] * 2 + [SECOND] * 2),
    "pp2xtp2": (["wrap=fsdp2", "mesh.pp=2", "mesh.tp=2"], 4,
                [[0, 0, 0, 0], [0, 0, 0, 1], [1, 0, 0, 0], [1, 0, 0, 1]], [FIRST] * 2 + [SECOND] * 2),
    "pp2xhsdp2": (["wrap=fsdp2", "mesh.pp=2", "mesh.dp_replicate=2"], 4,
                  [[0, 0, 0, 0], [0, 1, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]], [FIRST] * 2 + [SECOND] * 2),
    # Two stages per rank, looped (rank 0 holds stages 0 and 2: blocks 0 and 2), as one module of the whole model's
    # names: its units are its stages' blocks.
    "pp2xdp2-interleaved": (["wrap=fsdp2", "mesh.pp=2", "mesh.dp_shard=2", "mesh.pp_schedule=Interleaved1F1B",
                             "mesh.pp_stages_per_rank=2"], 4,
                            [[0, 0, 0, 0], [0, 0, 1, 0], [1, 0, 0, 0], [1, 0, 1, 0]],
                            [["blocks.0", "blocks.2"]] * 2 + [["blocks.1", "blocks.3"]] * 2),
    "pp2xdp2xtp2": (["wrap=fsdp2", "mesh.pp=2", "mesh.dp_shard=2", "mesh.tp=2"], 8,
                    [[p, 0, s, t] for p in (0, 1) for s in (0, 1) for t in (0, 1)], [FIRST] * 4 + [SECOND] * 4),
}


@pytest.mark.slow
@pytest.mark.timeout(600)  # past the launch's own 300 s: a launch that hangs is killed with its processes' stacks
@pytest.mark.parametrize("name", MESHES)
def test_a_pipelined_launch_trains_as_one_process_with_every_default_on(tmp_path, one_process, name):
    """PP alone, and each stage sharded (FSDP2), split (TP), replicated and sharded (HSDP), and all three (8 ranks)."""
    from mlflow import MlflowClient

    mesh, ranks, coordinates, units = MESHES[name]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    launched = run_cli(*SAME, *mesh, "trainer.max_steps=8", "checkpoint.every_n_steps=4",
                       f"launcher.nproc_per_node={ranks}", f"tracking.uri={uri}", cwd=tmp_path / "run", timeout=300)
    assert launched.returncode == 0, launched.stderr[-4000:]
    [job] = job_dirs(tmp_path / "run")
    result, expected = _result(job), one_process
    assert list(result["losses"].values()) == pytest.approx(list(expected["losses"].values()), abs=1e-5)
    assert result["eval_loss"] == pytest.approx(expected["eval_loss"], abs=1e-5)
    assert (job / "checkpoints" / "step_00000004").is_dir() and (job / "checkpoints" / "step_00000008").is_dir()
    if coordinates is not None:
        assert [report["mesh_coordinate"] for report in result["reports"]] == coordinates
        assert [report["units"] for report in result["reports"]] == units
    # Under FSDP2 the model was built on meta and each rank filled its own stages only; unwrapped, built whole.
    assert {report["init_device"] for report in result["reports"]} == {"meta" if "wrap=fsdp2" in mesh else "cpu"}
    # Every rank's report names the whole mesh, and its stage's blocks are its units (FSDP2's, each sharded).
    degrees = dict(o.removeprefix("mesh.").split("=") for o in mesh if o.startswith("mesh.") and "pp_" not in o)
    described = ",".join(f"{d}={degrees.get(d, 1)}" for d in ("pp", "dp_replicate", "dp_shard", "tp"))
    assert [report["mesh"] for report in result["reports"]] == [described] * ranks
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("hydraddp").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["hydraddp.mesh"] == described
    bubbles = [m.value for m in client.get_metric_history(run.info.run_id, "perf/pp_bubble")]
    assert len(bubbles) == 8 and all(0 <= b < 1 for b in bubbles), bubbles
    # The logged model is the whole model, gathered from both stages: the checkpoint's weights, every one of them.
    import mlflow
    import torch

    from hydraddp.train.formats import export

    mlflow.set_tracking_uri(uri)
    [logged] = client.search_logged_models([run.info.experiment_id])
    model = mlflow.pytorch.load_model(f"models:/{logged.model_id}")
    exported = torch.load(export(job / "checkpoints" / "step_00000008", tmp_path / "model.pt"), weights_only=True)
    assert sorted(model.state_dict()) == sorted(exported) and len(model.blocks) == 4
    assert [k for k, v in model.state_dict().items() if not torch.equal(v, exported[k])] == []


@pytest.mark.slow
def test_a_pipelined_checkpoint_resumes_at_its_own_mesh_and_at_other_pipeline_degrees_as_the_uninterrupted_run(
        tmp_path):
    """Stopped at step 5 at pp=2 x dp_shard=2, resumed there, at pp=1 x dp_shard=4 and at pp=4: each ends where the
    uninterrupted run does. At the same world size the other meshes split the data otherwise (rank 2 reads the first
    share at pp=2, the third at dp_shard=4), so each rank's saved loader position is not theirs to take."""
    pipelined = [*SAME, "wrap=fsdp2", "launcher.nproc_per_node=4", "tracking.enabled=false", "plan.record=false",
                 "checkpoint.every_n_steps=3", "trainer.max_steps=8"]
    whole = run_cli(*pipelined, "mesh.pp=2", "mesh.dp_shard=2", cwd=tmp_path / "whole")
    stopped = run_cli(*pipelined, "mesh.pp=2", "mesh.dp_shard=2", "trainer.stop_at_step=5", "hydra.run.dir=resumed",
                      cwd=tmp_path)
    assert whole.returncode == 0 and stopped.returncode == 0, whole.stderr[-3000:] + stopped.stderr[-3000:]
    step_5 = tmp_path / "resumed" / "checkpoints" / "step_00000005"
    [job] = job_dirs(tmp_path / "whole")
    expected = [_result(job)["losses"][k] for k in ("6", "7", "8")]
    for name, mesh in (("dp4", "mesh.dp_shard=4"), ("pp4", "mesh.pp=4")):
        elsewhere = run_cli(*pipelined, mesh, f"checkpoint.resume={step_5}", f"hydra.run.dir={name}", cwd=tmp_path)
        assert elsewhere.returncode == 0, elsewhere.stderr[-4000:]
        result = _result(tmp_path / name)
        assert list(result["losses"]) == ["6", "7", "8"], mesh
        assert list(result["losses"].values()) == pytest.approx(expected, abs=1e-5), mesh
    resumed = run_cli(*pipelined, "mesh.pp=2", "mesh.dp_shard=2", "checkpoint.resume=latest", "hydra.run.dir=resumed",
                      cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    result = _result(tmp_path / "resumed")
    assert list(result["losses"]) == ["6", "7", "8"]
    assert list(result["losses"].values()) == pytest.approx(expected, abs=1e-5)


NO_SHAPE = ["backend=gloo", "model=mlp", "data=digits"]  # the MLP declares no pipeline shape


@pytest.mark.parametrize("overrides, said", [
    ([*SAME, "wrap=ddp"], "mesh.pp=2 with wrap=ddp: each pipeline stage is sharded"),
    ([*SAME, "wrap=none", "mesh.tp=2", "launcher.nproc_per_node=4"], "mesh.pp=2 with wrap=none: each pipeline stage"),
    ([*SAME, "wrap=fsdp2", "mesh.pp_schedule=Interleaved1F1B"],
     "pp_schedule=Interleaved1F1B runs several stages on each rank, and pp_stages_per_rank=1; give 2 or more"),
    ([*SAME, "wrap=fsdp2", "precision=fp16"], "mesh.pp=2: fp16's gradient scaler is not run across pipeline stages"),
    ([*SAME, "wrap=fsdp2", "trainer.accumulate_grad_batches=2"],
     "Set mesh.pp_microbatches instead, and trainer.accumulate_grad_batches=1"),
    ([*SAME, "wrap=fsdp2", "mesh.pp_microbatches=3"], "mesh.pp_microbatches=3: each pipeline's batch of 8"),
    ([*NO_SHAPE, "wrap=fsdp2"], "mesh.pp=2: MLP declares no pipeline_shape"),
], ids=["ddp", "tp-unwrapped", "looped", "fp16", "accumulate", "microbatches", "no-shape"])
def test_what_a_pipeline_cannot_run_yet_is_refused_before_any_process_starts(tmp_path, overrides, said):
    refused = run_cli("mesh.pp=2", "launcher.nproc_per_node=2", "tracking.enabled=false", *overrides, cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert said in refused.stderr and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert job_dirs(tmp_path) == []
