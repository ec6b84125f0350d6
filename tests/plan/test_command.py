"""``python -m hydraddp.plan``: the same config and validation as a launch, every wrap in one table, a budget that
picks a combination which then runs within it, and a 1B-parameter model planned with no memory of that size."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers.spawn import run_process

pytestmark = pytest.mark.slow  # launches for real: see docs/development/tests.md

GPT = ["model=gpt", "data=text", "task=causal_lm", "data.batch_size=32", "backend=gloo", "launcher.nproc_per_node=2"]


# Runs a command as its only child and prints that child's peak RSS (KiB) last: RUSAGE_CHILDREN of pytest itself is
# the maximum over every child it ever waited for, so it depended on which tests ran before.
PEAK_RSS_OF_CHILD = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
                     "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)")


def plan(*overrides: str, tmp_path, timeout: float = 120, peak_rss: bool = False):
    out = tmp_path / "plan.json"
    command = [sys.executable, "-m", "hydraddp.plan", "--json", str(out), *overrides]
    launched = run_process([sys.executable, "-c", PEAK_RSS_OF_CHILD, *command] if peak_rss else command,
                           timeout=timeout)
    return launched, (json.loads(out.read_text()) if out.exists() else None)


def test_the_plan_shows_units_parts_and_every_wrap(tmp_path):
    launched, planned = plan(*GPT, "wrap=fsdp2", "precision=bf16", tmp_path=tmp_path)
    assert launched.returncode == 0, launched.stderr
    assert "wrap plan: 5 FSDP units" in launched.stdout and "blocks.3" in launched.stdout
    for part in ("parameters", "gradients", "optimizer state", "largest units gathered at once",
                 "activations at the peak", "peak"):
        assert f"  {part} " in launched.stdout, part
    assert set(planned["wraps"]) == {"none", "ddp", "fsdp", "fsdp2"}
    wraps = planned["wraps"]
    # Sharding halves what each of 2 ranks keeps, to the byte (the GPT's sizes divide by 2).
    assert wraps["fsdp2"]["param_bytes"] * 2 == wraps["ddp"]["param_bytes"]
    assert wraps["fsdp2"]["optim_state_bytes"] < wraps["ddp"]["optim_state_bytes"]
    assert wraps["fsdp2"]["peak_bytes"] < wraps["ddp"]["peak_bytes"]
    # The build: on the meta device under the FSDPs (the shards and one module's full tensors: the GPT's largest is
    # an MLP matrix with its bias), whole under ddp.
    import torch
    from hydraddp.models.gpt import GPT as Model

    with torch.device("meta"):
        model = Model(seq_len=64)
    whole = sum(p.numel() * 4 for p in model.parameters())
    largest = max(sum(p.numel() * 4 for p in m.parameters(recurse=False)) for m in model.modules())
    assert largest == (128 * 512 + 512) * 4
    assert (wraps["fsdp2"]["build"], wraps["fsdp2"]["build_bytes"]) == ("meta", wraps["fsdp2"]["param_bytes"] + largest)
    assert (wraps["ddp"]["build"], wraps["ddp"]["build_bytes"]) == ("whole", whole)
    assert "build: on the meta device, then its shards filled one module at a time" in launched.stdout
    assert "Warning" not in launched.stderr and "Traceback" not in launched.stderr


def test_a_config_a_launch_refuses_exits_2_naming_the_key(tmp_path):
    launched, planned = plan("model=mlp", "wrap=fsdp2", "trainer.activation_checkpointing=true", tmp_path=tmp_path)
    assert launched.returncode == 2 and planned is None
    # The launch's own words (a launch says it from rank 0, before training): the fix included.
    assert "activation checkpointing works per block, and MLP declares none" in launched.stderr
    assert "turn activation checkpointing off" in launched.stderr and "Traceback" not in launched.stderr
    launched, _ = plan("wrap=fsdp3", tmp_path=tmp_path)
    assert launched.returncode == 2 and "wrap" in launched.stderr and "Traceback" not in launched.stderr


def test_a_budget_picks_a_combination_that_then_runs_within_it(pools, tmp_path):
    _, everything_fits = plan(*GPT, "plan.budget_gb=1000", tmp_path=tmp_path)
    needs = {c["label"]: c["needs_bytes"] for c in everything_fits["budget"]["choices"]}
    assert everything_fits["budget"]["recommended"] == ["wrap=ddp"], needs  # the fastest, when it fits
    # Between what the checkpointed and the plain fsdp2 peaks need: only recomputing the activations fits.
    budget_gb = (needs["fsdp2 + activation checkpointing"] + needs["fsdp2"]) / 2 / 1024**3
    launched, planned = plan(*GPT, f"plan.budget_gb={budget_gb}", tmp_path=tmp_path)
    assert launched.returncode == 0, launched.stderr
    recommended = planned["budget"]["recommended"]
    assert "trainer.activation_checkpointing=true" in recommended, planned["budget"]
    assert "recommended:" in launched.stdout and "recomputed" in launched.stdout
    steps = ["trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_every=0", "tracking.enabled=false"]
    ran = pools.run("tests.plan.workers:measured", {"recommended": [*GPT, *steps, *recommended]}, timeout=300)
    measured = max(peak["peak_bytes"] for peak in ran[0]["recommended"]["tensor_peaks"])
    assert measured <= budget_gb * 1024**3, (measured, planned["budget"])


def test_a_budget_nothing_fits_exits_2_with_the_smallest_requirement(tmp_path):
    launched, planned = plan(*GPT, "plan.budget_gb=0.001", tmp_path=tmp_path)
    assert launched.returncode == 2
    assert "plan.budget_gb=0.001: nothing fits; the smallest needs" in launched.stderr
    smallest = min(c["needs_bytes"] for c in planned["budget"]["choices"] if c["needs_bytes"])
    assert f"{smallest / 1024**2:.2f} MiB" in launched.stderr


def test_a_1b_parameter_gpt_is_planned_with_no_memory_of_its_size(tmp_path):
    # Wide and shallow: a billion parameters in 4 blocks, as few fake ops to trace as the size allows.
    one_b = ["model=gpt", "data=text", "task=causal_lm", "model.dim=4096", "model.depth=4", "model.heads=32",
             "data.seq_len=512", "model.vocab_size=32000", "data.batch_size=4", "wrap=fsdp2", "backend=gloo"]
    launched, planned = plan(*one_b, tmp_path=tmp_path, timeout=300, peak_rss=True)
    assert launched.returncode == 0, launched.stderr
    assert sum(u["numel"] for u in planned["plan"]["units"]) > 1.0e9
    assert planned["wraps"]["ddp"]["param_bytes"] > 4e9  # 1.04B fp32 parameters, counted, not held
    # The planning process's own peak RSS, in KiB: far below the 16 GiB the plan describes.
    assert int(launched.stdout.strip().splitlines()[-1]) < 2 * 1024**2


def test_a_mesh_config_is_planned_on_every_mesh_of_its_world(tmp_path):
    """mesh.tp=2 at 2 ranks: the config's own plan on its 2-D (dp_shard, tp) mesh, and one row per mesh of the world
    (1-D fsdp2, HSDP, TP, two pipeline stages), each planned in its own simulated world."""
    launched, planned = plan(*GPT, "wrap=fsdp2", "mesh.tp=2", tmp_path=tmp_path)
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert "every mesh under fsdp2 (dp_replicate x dp_shard x tp; pp x dp_replicate x dp_shard x tp" in launched.stdout
    meshes = planned["meshes"]
    # The GPT's blocks fill two pipeline stages: pp=2 is a mesh of this world too (2x1x1x1: pp x dp_replicate x
    # dp_shard x tp), each rank holding half the blocks.
    assert set(meshes) == {"1x2x1", "2x1x1", "1x1x2", "2x1x1x1"} and planned["plan"]["mesh"] == "1x1x2"
    assert meshes["2x1x1x1"]["param_bytes"] <= meshes["2x1x1"]["param_bytes"] * 0.6
    assert "1x1x2" in next(line for line in launched.stdout.splitlines() if "<- this config" in line and "x" in line)
    # Split two ways (by FSDP's shards or by TP's; TP keeps its norms whole) against replicated whole: about half the
    # parameters per rank.
    for split in ("1x2x1", "1x1x2"):
        assert meshes[split]["param_bytes"] <= meshes["2x1x1"]["param_bytes"] * 0.51, split
    # The data-parallel degree is 1 under TP alone: each rank computes on the whole batch of 32.
    assert meshes["1x1x2"]["batch_per_rank"] == 32 and meshes["1x2x1"]["batch_per_rank"] == 16
