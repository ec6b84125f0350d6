"""A LoRA fine-tune (peft's, on a transformers Llama: base frozen, adapters trainable) as a user model, with every
default on: the plan's measured step once failed on every rank ("cannot register a hook on a tensor that doesn't
require gradient"), the plan itself could not build a peft model ("Couldn't swap Linear.weight"), and the meta build
gave every base weight after the first adapter other values than the whole build. Gradients, optimizer state and the
plan count only what trains."""

from __future__ import annotations

import json

import pytest
import torch

from hydraddp.config.compose import compose
from hydraddp.plan.estimate import estimate
from tests.helpers.lora import is_adapter, tiny_lora_llama
from tests.helpers.spawn import job_dirs, run_cli

pytest.importorskip("peft", reason="the test extra: pip install -e '.[test]'")

LORA = ["model._target_=tests.helpers.lora.tiny_lora_llama", "data=tokens", "task=causal_lm"]
SMALL = ["data.seq_len=16", "data.batch_size=8", "data.eval_batch_size=16", "data.dataset.num_chars=4000"]


def adapters() -> list[torch.Tensor]:
    return [p for name, p in tiny_lora_llama().named_parameters() if p.requires_grad]


def adapter_bytes(shards: int, element_size: int) -> tuple[int, int]:
    """(gradient bytes, AdamW state bytes) of one rank when each adapter is split evenly over ``shards`` ranks: two
    moments in the gradients' dtype, and a 4-byte step count per parameter."""
    trainable = adapters()
    grads = sum(p.numel() for p in trainable) * element_size // shards
    return grads, 2 * grads + 4 * len(trainable)


def test_the_helper_is_a_peft_lora_llama_whose_adapters_alone_train():
    model = tiny_lora_llama()
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert type(model).__name__ == "PeftModelForCausalLM" and trainable and all(map(is_adapter, trainable))
    assert len(trainable) == 2 * 2 * 2  # q_proj and v_proj of 2 layers, A and B each


@pytest.mark.parametrize("wrap, precision, shards, element_size", [
    ("fsdp2", "bf16", 2, 4),  # the issue's: fp32 gradients and state under mixed precision, each rank half of them
    ("ddp", "bf16-true", 1, 2),  # the weights, their gradients and the state in bf16 (the plan once failed to cast)
])
def test_the_plan_counts_gradients_and_optimizer_state_of_the_adapters_only(wrap, precision, shards, element_size):
    planned = estimate(compose([*LORA, *SMALL, f"wrap={wrap}", f"precision={precision}", "backend=gloo",
                                "launcher.nproc_per_node=2"]), world_size=2, rank=0)
    assert (planned.grad_bytes, planned.optim_state_bytes) == adapter_bytes(shards, element_size)
    assert planned.param_bytes == sum(p.numel() for p in tiny_lora_llama().parameters()) * element_size // shards


def test_every_wrap_trains_the_adapters_and_leaves_the_base_as_built(pools):
    """2 ranks in a reused gloo group, every wrap and precision, the meta build (init_device=auto) and the whole one."""
    cases = {"ddp-fp32": ["wrap=ddp", "precision=fp32"],
             "ddp-bf16-true": ["wrap=ddp", "precision=bf16-true"],
             "fsdp-bf16": ["wrap=fsdp", "precision=bf16"],
             "fsdp-fp32-cpu": ["wrap=fsdp", "precision=fp32", "model.init_device=cpu"],
             "fsdp2-bf16": ["wrap=fsdp2", "precision=bf16"],
             "fsdp2-hsdp-bf16-true": ["wrap=fsdp2", "precision=bf16-true", "mesh.dp_replicate=2", "mesh.dp_shard=1"]}
    out = pools.run("tests.train.workers:lora_steps", cases, timeout=600)
    trainable = sum(p.numel() for p in adapters())
    for name, seen in out[0].items():
        assert seen["finite"], (name, seen["losses"])
        assert seen["base_changed"] == [], name  # bit for bit: frozen, and the meta build is the whole build's
        assert seen["adapters"] and seen["adapters_unchanged"] == [], name
        assert seen["optimized_all_trainable"] and seen["optimized"] == seen["trainable"], name
        report = seen["report"]
        assert (report["trainable_numel"], report["total_numel"]) == (trainable, sum(
            p.numel() for p in tiny_lora_llama().parameters())), name
        assert report["init_device"] == ("cpu" if "cpu" in name or name.startswith("ddp") else "meta"), name
        # FSDP1 keeps frozen and trainable parameters in one unit only with its original parameters: set for them.
        assert report["use_orig_params"] is (True if name.startswith("fsdp-") else None), name
    assert all(seen["base_changed"] == seen["adapters_unchanged"] == [] for seen in out[1].values())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_lora_fine_tune_trains_with_every_default_on_and_resumes(tmp_path):
    """The issue's run, launched for real (the tracker, the recorded plan and the measured step are the launch's):
    fsdp2 bf16 on 2 ranks, stopped at step 3 and resumed to step 6 into the same MLflow run."""
    overrides = [*LORA, *SMALL, "wrap=fsdp2", "precision=bf16", "trainer.max_steps=6", "trainer.log_every=1",
                 "trainer.eval_every=3", "checkpoint.every_n_steps=3", f"tracking.uri=sqlite:///{tmp_path}/m.db"]
    first = run_cli(*overrides, "trainer.stop_at_step=3", cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-4000:]
    [job] = job_dirs(tmp_path)
    resumed = run_cli(*overrides, "checkpoint.resume=latest", f"hydra.run.dir={job}", cwd=tmp_path, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    log = (job / "logs" / "rank0.log").read_text()
    assert "step 3 loss" in log and "resumed from" in log and "step 6 loss" in log
    assert "building the model whole" not in log  # the meta build holds: no fallback
    result = json.loads((job / "result.json").read_text())
    assert all(torch.isfinite(torch.tensor(loss)) for loss in result["losses"].values())
    # The plan the launch recorded, against the model's adapters and what the run measured.
    plan = json.loads((job / "plan.json").read_text())
    assert (plan["grad_bytes"], plan["optim_state_bytes"]) == adapter_bytes(2, 4)
    report = json.loads((job / "wrap_report.json").read_text())[0]
    assert (plan["grad_bytes"], plan["optim_state_bytes"]) == (report["grad_bytes"], report["optim_state_bytes"])
    assert report["trainable_numel"] == sum(p.numel() for p in adapters()) < report["total_numel"]
    final = _checkpointed_model(job / "checkpoints" / "step_00000006")
    torch.manual_seed(0)  # trainer.seed: the whole build the run's meta build equals
    built = tiny_lora_llama().state_dict()
    assert final.keys() == built.keys()
    assert [k for k in built if not is_adapter(k) and not torch.equal(final[k], built[k])] == []
    assert [k for k in built if is_adapter(k) and torch.equal(final[k], built[k])] == []
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/m.db")
    [run] = client.search_runs([client.get_experiment_by_name("hydraddp").experiment_id])
    assert run.info.status == "FINISHED" and run.data.metrics["sharding/grad_bytes/rank0"] == report["grad_bytes"]
    assert "memory/peak_tensor_bytes/rank0" in run.data.metrics  # the step plan.measure measured


def _checkpointed_model(path) -> dict[str, torch.Tensor]:
    """The model's full state dict from a hydraddp checkpoint (DCP), read in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, path.parent / "whole.pt")
    state = torch.load(path.parent / "whole.pt", weights_only=False)
    return {k: v for k, v in state["model"].items()}
