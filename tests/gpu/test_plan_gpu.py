"""The plan against CUDA's own count: ``max_memory_allocated`` over the run's second step (``TensorPeak`` on CUDA),
within 10% of what ``hydraddp.plan`` predicts in its simulated world, and the bytes per rank exact."""

import pytest
import torch

from hydraddp.config.compose import compose
from hydraddp.plan.estimate import estimate
from tests.helpers.spawn import run_parallel

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
# cuBLAS's workspaces, allocated through the same allocator, are in the plan's peak (hydraddp/plan/cuda.py).
GPT = ["model=gpt", "data=text", "task=causal_lm", "model.dim=512", "model.depth=4", "model.heads=8",
       "data.seq_len=256", "data.batch_size=16", "trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_every=0",
       "tracking.enabled=false"]


@pytest.mark.parametrize("world, wrap, precision", [
    pytest.param(1, "none", "fp32", id="1gpu-none-fp32"),
    pytest.param(1, "none", "bf16", id="1gpu-none-bf16"),
    pytest.param(2, "ddp", "bf16", id="2gpu-ddp-bf16", marks=pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")),
    pytest.param(2, "fsdp2", "bf16", id="2gpu-fsdp2-bf16", marks=pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")),
])
def test_the_plan_holds_cuda_max_memory_allocated_to_ten_percent(tmp_path, world, wrap, precision):
    backend = "nccl" if world > 1 else "none"
    overrides = [*GPT, f"wrap={wrap}", f"precision={precision}", f"backend={backend}", f"launcher.nproc_per_node={world}"]
    ran = run_parallel("tests.plan.workers:measured", {"case": overrides}, backend=backend, nproc=world,
                       tmp_path=tmp_path, timeout=300)
    report, peak = ran[0]["case"]["reports"][0], ran[0]["case"]["tensor_peaks"][0]
    planned = estimate(compose(overrides), world_size=world)
    assert (planned.param_bytes, planned.grad_bytes, planned.optim_state_bytes) == (
        report["param_bytes"], report["grad_bytes"], report["optim_state_bytes"])
    assert abs(planned.peak_bytes - peak["peak_bytes"]) <= 0.10 * peak["peak_bytes"], (planned.peak_bytes, peak)
