"""The device mesh (mesh.dp_replicate x mesh.dp_shard x mesh.tp): its shape against the world, the wrap and the node,
refused before launch with the key and the fix; HSDP (fsdp2 on a 2-D mesh) at 4 gloo ranks trains as one process does,
says its mesh and each rank's place in it, and its checkpoints reshard to 1-D fsdp2 and back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hydraddp.distributed as idist
from hydraddp.config.compose import compose
from hydraddp.preflight.config import problems
from hydraddp.preflight.model import model_problems
from hydraddp.parallel.mesh import MeshShape
from tests.parallel.test_meta_init import FACTORIES, SEED, trained


def test_the_ranks_left_fill_dp_shard_and_a_product_off_the_world_is_an_error():
    assert MeshShape(2, -1, 1).resolved(8) == MeshShape(2, 4, 1)
    assert MeshShape.of({"dp_replicate": 2, "dp_shard": 2}).describe() == "dp_replicate=2,dp_shard=2,tp=1"
    with pytest.raises(ValueError, match="mesh dp_replicate=2,dp_shard=3,tp=1 is 6 ranks, but the world size is 4"):
        MeshShape(2, 3, 1).resolved(4)
    with pytest.raises(ValueError, match="does not divide the world size 4"):
        MeshShape(3, -1, 1).resolved(4)


@pytest.mark.parametrize("overrides, keys, says", [
    (["wrap=fsdp2", "mesh.dp_replicate=2", "mesh.dp_shard=3", "launcher.nproc_per_node=4"],
     ("mesh.dp_replicate", "mesh.dp_shard", "mesh.tp"), "is 6 ranks, but the world size is 4"),
    (["wrap=fsdp", "mesh.dp_replicate=2", "launcher.nproc_per_node=4"], ("mesh.dp_replicate", "wrap"),
     "needs wrap=fsdp2"),
    (["wrap=ddp", "mesh.dp_replicate=2", "launcher.nproc_per_node=4"], ("mesh.dp_replicate", "wrap"),
     "DDP: mesh.dp_replicate equal to the world size"),
    (["wrap=ddp", "mesh.tp=2", "launcher.nproc_per_node=4"], ("mesh.tp", "wrap"), "needs wrap=fsdp2"),
    (["wrap=fsdp2", "mesh.dp_shard=1", "mesh.tp=4", "launcher.nproc_per_node=2", "launcher.nnodes=2"],
     ("mesh.tp", "launcher.nproc_per_node"), "mesh.tp=4 is more than the 2 processes of a node"),
])
def test_a_mesh_that_cannot_run_is_refused_before_launch(overrides, keys, says):
    found = [p for p in problems(compose(["backend=gloo", *overrides])) if p.keys[0].startswith("mesh.")]
    assert len(found) == 1 and found[0].keys == keys and says in found[0].message, found


def test_the_meshes_that_run_pass():
    for overrides in (["wrap=fsdp2", "mesh.dp_replicate=2", "mesh.dp_shard=2"], ["wrap=ddp", "mesh.dp_replicate=4"],
                      ["wrap=fsdp2"], ["wrap=ddp"], ["wrap=fsdp2", "mesh.dp_shard=2", "mesh.tp=2"],
                      ["wrap=fsdp2", "mesh.tp=2", "data.batch_size=6"]):  # 6 splits over 2 data-parallel ranks
        cfg = compose(["backend=gloo", "launcher.nproc_per_node=4", *overrides])
        assert problems(cfg) + model_problems(cfg, overrides) == [], overrides


GPT = ["model=gpt", "data=text", "task=causal_lm", "model.dim=32", "model.heads=2", "data.seq_len=16"]


@pytest.mark.parametrize("overrides, keys, says", [
    (["data.batch_size=5"], ("data.batch_size", "launcher.nproc_per_node"),
     "does not split evenly over the data-parallel degree 2 (the world size 4 over mesh.tp"),
    ([*GPT, "mesh.dp_shard=1", "mesh.tp=4"], ("mesh.tp",), "mesh.tp=4 does not divide the model's heads=2"),
    ([*GPT, "model.dim=30", "model.heads=6", "mesh.dp_shard=1", "mesh.tp=4", "launcher.nproc_per_node=4"],
     ("mesh.tp",), "does not divide blocks.0.attn.qkv's out_features (90)"),
    (["model.batch_norm=true"], ("mesh.tp", "wrap.tp_plan"), "MLP declares none (no tp_plan"),
    (["wrap.tp_plan={0: colwise, 9: rowwise}"], ("wrap.tp_plan",), "the TP plan's entry '9' matches no module"),
    (["wrap.tp_plan={0: diagonal}"], ("wrap.tp_plan",), "the style 'diagonal', which hydraddp does not know"),
    (["mesh.tp=1", "wrap.tp_plan={0: colwise}"], ("wrap.tp_plan", "mesh.tp"), "tensor parallel does not run"),
])
def test_tensor_parallel_is_refused_before_launch_with_the_key_and_the_fix(overrides, keys, says):
    """Each TP problem a launch would meet, found by validation (``problems``) or on the meta-built model
    (``model_problems``): the launch's two checks, in its order."""
    every = ["backend=gloo", "wrap=fsdp2", "mesh.tp=2", "launcher.nproc_per_node=4", *overrides]
    cfg = compose(every)
    found = problems(cfg) or model_problems(cfg, every)
    assert {p.keys for p in found} == {keys} and any(says in p.message for p in found), found
    assert all(p.fix for p in found), found


def test_a_tp_launch_without_a_plan_exits_2_naming_how_to_give_one(tmp_path):
    from tests.helpers.spawn import run_cli

    launched = run_cli("backend=gloo", "wrap=fsdp2", "mesh.tp=2", "launcher.nproc_per_node=2", "model.batch_norm=true",
                       "tracking.enabled=false", cwd=tmp_path)
    assert launched.returncode == 2, launched.stderr[-2000:]
    assert "wrap.tp_plan=" in launched.stderr and "Traceback" not in launched.stderr
    assert not list(tmp_path.glob("outputs/*/*/checkpoints"))


def hsdp_trained(local_rank: int, name: str) -> dict:
    """HSDP 2 x 2: the global losses of 10 steps, the full parameters after them, and the report."""
    from tests.distributed.workers import full_params

    from hydraddp.parallel.meta_init import build_on_meta

    torch.manual_seed(SEED)
    model, _ = build_on_meta(FACTORIES[name])
    wrapped = idist.auto_model(model, wrap="fsdp2", mesh_shape=(2, 2, 1))
    report = idist.wrap_report(wrapped)
    losses, wrapped = trained(name, wrapped, idist.get_rank(), idist.get_world_size())
    return {"losses": losses, "params": {k: v.cpu() for k, v in full_params(wrapped).items()},
            "mesh": report.mesh, "mesh_shape": report.mesh_shape, "coordinate": report.mesh_coordinate,
            "local_numel": report.local_numel, "total_numel": report.total_numel}


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_hsdp_on_four_ranks_trains_as_one_process_and_says_its_mesh(pools, name):
    torch.manual_seed(SEED)
    expected_losses, whole = trained(name, FACTORIES[name]())
    expected = whole.state_dict()
    out = pools.run("tests.parallel.test_mesh:hsdp_trained", name, nproc=4)
    for rank in range(4):
        seen = out[rank]
        assert seen["losses"] == pytest.approx(expected_losses, abs=1e-5), rank
        worst = max((seen["params"][k] - expected[k].float()).abs().max().item() for k in expected)
        assert worst <= 1e-5, (rank, worst)
        assert seen["mesh"] == "dp_replicate=2,dp_shard=2,tp=1" and seen["mesh_shape"] == [2, 2]
        assert seen["coordinate"] == [rank // 2, rank % 2, 0]
        # Sharded two ways, replicated two ways: each rank holds about half the model.
        assert seen["local_numel"] <= seen["total_numel"] // 2 + 1000, seen
    assert out[0]["local_numel"] == out[2]["local_numel"]  # replicas hold the same shard


def saved_under(local_rank: int, root: str, mesh_shape: tuple, seed: int) -> str:
    """A checkpoint of the small GPT under fsdp2 on ``mesh_shape`` (after one SGD step from ``seed``); its path."""
    from hydraddp.train import checkpoint

    torch.manual_seed(seed)
    model = idist.auto_model(FACTORIES["gpt"](), wrap="fsdp2", mesh_shape=mesh_shape)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randint(0, 64, (4, 16))).sum().backward()
    optimizer.step()
    return str(checkpoint.save(Path(root), 1, model, optimizer, {"config": {}}))


def loaded_under(local_rank: int, path: str, mesh_shape: tuple) -> dict:
    """The full parameters of the small GPT under fsdp2 on ``mesh_shape``, loaded from ``path``."""
    from hydraddp.train import checkpoint
    from tests.distributed.workers import full_params

    torch.manual_seed(99)  # other weights than the checkpoint's, so that the load shows
    model = idist.auto_model(FACTORIES["gpt"](), wrap="fsdp2", mesh_shape=mesh_shape)
    checkpoint.load(Path(path), model, torch.optim.SGD(model.parameters(), lr=0.1))
    return {k: v.cpu() for k, v in full_params(model).items()}


def test_a_checkpoint_reshards_between_hsdp_and_one_dimensional_fsdp2_and_into_tp(pools, tmp_path):
    hsdp = pools.run("tests.parallel.test_mesh:saved_under", str(tmp_path / "hsdp"), (2, 2, 1), 1, nproc=4)[0]
    flat = pools.run("tests.parallel.test_mesh:saved_under", str(tmp_path / "flat"), (1, 2, 1), 2)[0]
    reference = {source: pools.run("tests.parallel.test_mesh:loaded_under", path, shape, nproc=n)[0]
                 for source, path, shape, n in (("hsdp", hsdp, (2, 2, 1), 4), ("flat", flat, (1, 2, 1), 2))}
    into_flat = pools.run("tests.parallel.test_mesh:loaded_under", hsdp, (1, 2, 1))[0]
    into_hsdp = pools.run("tests.parallel.test_mesh:loaded_under", flat, (2, 2, 1), nproc=4)[0]
    into_tp = pools.run("tests.parallel.test_mesh:loaded_under", hsdp, (1, 1, 2))[0]  # and into tensor parallel
    assert [k for k in into_flat if not torch.equal(into_flat[k], reference["hsdp"][k])] == []
    assert [k for k in into_hsdp if not torch.equal(into_hsdp[k], reference["flat"][k])] == []
    assert [k for k in into_tp if not torch.equal(into_tp[k], reference["hsdp"][k])] == []
    assert any(not torch.equal(reference["hsdp"][k], reference["flat"][k]) for k in into_flat)  # two trainings


@pytest.mark.slow
def test_an_fsdp2_and_tp_launch_trains_as_one_process_and_names_its_mesh(tmp_path):
    """python -m hydraddp wrap=fsdp2 mesh.dp_shard=2 mesh.tp=2 on 4 gloo ranks, with the plan, tracking, gradient
    clipping and checkpoints (written in the background) on: the losses of one process, and the mesh in the report,
    the run, its params and its plan."""
    import json

    from mlflow import MlflowClient

    from tests.helpers.spawn import job_dirs, run_cli

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    same = ["model=gpt", "data=text", "task=causal_lm", "model.depth=2", "model.dim=32", "model.heads=2",
            "data.dataset.num_chars=4000", "data.batch_size=8", "trainer.max_steps=6", "trainer.log_every=1",
            "trainer.eval_every=0", "trainer.grad_clip=0.5", "wrap=fsdp2", "backend=gloo"]
    launched = run_cli(*same, "checkpoint.every_n_steps=3", "mesh.dp_shard=2", "mesh.tp=2",
                       "launcher.nproc_per_node=4", f"tracking.uri={uri}", "tracking.model.enabled=false",
                       cwd=tmp_path / "run", timeout=300)
    assert launched.returncode == 0, launched.stderr[-4000:]
    alone = run_cli(*same, "launcher.nproc_per_node=1", "tracking.enabled=false", cwd=tmp_path / "alone")
    assert alone.returncode == 0, alone.stderr[-4000:]
    [job], [one] = job_dirs(tmp_path / "run"), job_dirs(tmp_path / "alone")
    result, expected = (json.loads((d / "result.json").read_text()) for d in (job, one))
    assert list(result["losses"].values()) == pytest.approx(list(expected["losses"].values()), abs=1e-5)
    assert len(result["losses"]) == 6 and result["eval_loss"] == pytest.approx(expected["eval_loss"], abs=1e-5)
    assert [r["mesh"] for r in result["reports"]] == ["dp_replicate=1,dp_shard=2,tp=2"] * 4
    assert [r["mesh_coordinate"] for r in result["reports"]] == [[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1]]
    assert (job / "checkpoints" / "step_00000003").is_dir() and (job / "plan.json").exists()
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("hydraddp").experiment_id])
    assert run.data.tags["hydraddp.mesh"] == "dp_replicate=1,dp_shard=2,tp=2"
    assert {k: run.data.params[k] for k in ("mesh.dp_replicate", "mesh.dp_shard", "mesh.tp")} == \
        {"mesh.dp_replicate": "1", "mesh.dp_shard": "2", "mesh.tp": "2"}
    planned = json.loads((job / "plan.json").read_text())
    assert "error" not in planned and planned["mesh"] == "1x2x2", planned.get("error")
    # Split two ways by TP, sharded two ways by FSDP: a quarter of the model per rank, as measured.
    assert planned["param_bytes"] == result["reports"][0]["param_bytes"]


def tp_trained(local_rank: int, name: str, mesh_shape: tuple, on_meta: bool) -> dict:
    """FSDP2 + TP on ``mesh_shape``: the global losses of 10 steps, the full parameters after them, and the report."""
    from tests.distributed.workers import full_params

    from hydraddp.parallel.meta_init import build_on_meta

    torch.manual_seed(SEED)
    model = build_on_meta(FACTORIES[name])[0] if on_meta else FACTORIES[name]()
    wrapped = idist.auto_model(model, wrap="fsdp2", mesh_shape=mesh_shape)
    report = idist.wrap_report(wrapped)
    shape = MeshShape.of(mesh_shape).resolved(idist.get_world_size())
    losses, wrapped = trained(name, wrapped, idist.get_rank() // shape.tp, shape.dp, shape.tp)
    loader = idist.auto_dataloader(list(range(16)), batch_size=8, shuffle=True, mesh_shape=mesh_shape)
    return {"losses": losses, "first_batch": next(iter(loader)).tolist(), "params": {k: v.cpu() for k, v in full_params(wrapped).items()},
            "mesh": report.mesh, "mesh_shape": report.mesh_shape, "coordinate": report.mesh_coordinate,
            "local_numel": report.local_numel, "total_numel": report.total_numel}


@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("mesh_shape, on_meta", [((1, 1, 2), False), ((1, 2, 2), True)], ids=["tp2", "fsdp2xtp2"])
def test_tensor_parallel_trains_as_one_process_and_says_its_mesh(pools, name, mesh_shape, on_meta):
    """TP alone at 2 ranks (built whole), FSDP2 + TP 2 x 2 at 4 (built on meta: TP's shards filled after sharding)."""
    torch.manual_seed(SEED)
    expected_losses, whole = trained(name, FACTORIES[name]())
    expected = whole.state_dict()
    world = MeshShape.of(mesh_shape).size
    out = pools.run("tests.parallel.test_mesh:tp_trained", name, mesh_shape, on_meta, nproc=world)
    for rank in range(world):
        seen = out[rank]
        assert seen["losses"] == pytest.approx(expected_losses, abs=1e-5), rank
        worst = max((seen["params"][k] - expected[k].float()).abs().max().item() for k in expected)
        assert worst <= 1e-5, (rank, worst)
        assert seen["mesh"] == MeshShape.of(mesh_shape).describe()
        assert seen["coordinate"] == [0, rank // 2, rank % 2]
        # Split two ways by TP (and two more by FSDP): each rank holds about its share of the model.
        assert seen["local_numel"] <= seen["total_numel"] * 2 // world, seen
    # auto_dataloader(mesh_shape=...): a TP group reads one share of the batch, the data-parallel ranks the others.
    batches = [out[rank]["first_batch"] for rank in range(0, world, 2)]
    assert all(out[rank]["first_batch"] == out[rank - 1]["first_batch"] for rank in range(1, world, 2))
    assert sorted(sum(batches, [])) == sorted(set(sum(batches, []))) and len(sum(batches, [])) == 8
