"""The measured step (plan.measure, on by default): torch's MemTracker over a whole step, accumulation included."""

import pytest
import torch
from torch import nn

from hydraddp.train.metrics import TensorPeak
from hydraddp.train.step import train_step
from hydraddp.train.tasks import Classification


def measured_step(accumulate: int) -> TensorPeak:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.Adam(model.parameters())
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    train_step(model, Classification(), batch, optimizer, None, 1.0, False, accumulate)  # makes the Adam state
    with TensorPeak(model, optimizer) as peak:
        train_step(model, Classification(), batch, optimizer, None, 1.0, False, accumulate)
    return peak


@pytest.mark.parametrize("accumulate", [2, 4])
def test_a_step_of_several_micro_batches_is_measured_like_one(accumulate):
    # The model runs once per micro-batch inside one measured span: torch's MemTracker refused the second run.
    whole, micro = measured_step(1), measured_step(accumulate)
    numel = sum(p.numel() for p in nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4)).parameters())
    assert whole.parts["parameters"] == micro.parts["parameters"] == 4 * numel
    assert whole.parts["gradients"] == micro.parts["gradients"] == 4 * numel  # accumulated in place, not per micro
    assert whole.parts["optimizer_state"] == micro.parts["optimizer_state"] >= 2 * 4 * numel  # Adam's two moments
    assert 0 < sum(micro.parts.values()) <= micro.peak_bytes  # the parts at the peak, which is the most held


@pytest.mark.parametrize("device_name, dtype, tf32, expected_tflops", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, False, 989.4),  # the SXM part
    ("NVIDIA H100 PCIe", torch.bfloat16, False, 756.0),  # once counted as the SXM part: 31% too high a peak
    ("NVIDIA H100 NVL", torch.float16, False, 835.5),
    ("NVIDIA H200", torch.bfloat16, False, 989.4),
    ("NVIDIA H200", torch.float32, False, 66.9),  # fp32 once measured against the bf16 peak: 15x too high
    ("NVIDIA H200", torch.float32, True, 494.7),  # fp32 matmuls on tensor cores (TF32 allowed)
    ("NVIDIA A100-SXM4-80GB", torch.float32, False, 19.5),
    ("NVIDIA L40S", torch.bfloat16, False, 362.1),  # not the L4's
    ("NVIDIA L4", torch.bfloat16, False, 121.0),
    ("Some Future GPU", torch.bfloat16, False, None),  # unknown: no MFU rather than a guess
])
def test_the_peak_is_the_device_models_in_the_compute_dtype(monkeypatch, device_name, dtype, tf32, expected_tflops):
    from hydraddp.train.metrics import peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)  # no GPU here to name
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        peak = peak_flops(torch.device("cuda", 0), dtype)
    finally:
        torch.set_float32_matmul_precision(before)
    assert peak == (expected_tflops * 1e12 if expected_tflops is not None else None)


def test_trainer_peak_tflops_overrides_the_table_on_any_device():
    from hydraddp.train.metrics import peak_flops

    assert peak_flops(torch.device("cpu"), torch.float32) is None
    assert peak_flops(torch.device("cpu"), torch.float32, peak_tflops=2.5) == 2.5e12


def test_a_model_with_frozen_parameters_is_measured_and_only_what_trains_has_gradients():
    """A LoRA-style model (frozen base, trainable adapter): the measured step once failed on every rank with "cannot
    register a hook on a tensor that doesn't require gradient" (plan.measure is on by default)."""
    torch.manual_seed(0)
    base, adapter = nn.Linear(16, 16), nn.Linear(16, 4)
    base.requires_grad_(False)
    model = nn.Sequential(base, nn.ReLU(), adapter)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    train_step(model, Classification(), batch, optimizer, None, 1.0, False, 1)
    with TensorPeak(model, optimizer) as peak:
        train_step(model, Classification(), batch, optimizer, None, 1.0, False, 1)
    trainable = sum(p.numel() for p in adapter.parameters())
    assert peak.parts["parameters"] == 4 * (trainable + sum(p.numel() for p in base.parameters()))
    assert 0 < sum(peak.parts.values()) <= peak.peak_bytes
    assert peak.parts.get("gradients", 0) <= 4 * trainable  # the frozen base has none
    assert base.weight.grad is None and adapter.weight.grad is not None


def test_the_peak_is_torchs_memtrackers_own_without_its_walk_over_every_module_after_each_operator():
    """TensorPeak reads only the span's peak, so it skips the stock tracker's per-module peaks: a walk of every module
    after each operator, which made a 70B-sized plan (80 layers) run past ten minutes. The numbers stay torch's."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from hydraddp.models.gpt import GPT
    from hydraddp.train.tasks import CausalLM

    def step(model, optimizer):
        tokens = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(1))
        train_step(model, CausalLM(), (tokens[:, :-1], tokens[:, 1:]), optimizer, None, 1.0, False, 1)

    torch.manual_seed(0)
    model = GPT(depth=3, dim=32, heads=2, seq_len=16)
    optimizer = torch.optim.AdamW(model.parameters())
    step(model, optimizer)
    stock = MemTracker()
    stock.track_external(model, optimizer)
    with stock:
        step(model, optimizer)
    with TensorPeak(model, optimizer) as peak:
        step(model, optimizer)
    stock_peak = {getattr(k, "value", k): v for per in stock.get_tracker_snapshot("peak").values() for k, v in per.items()}
    assert peak.peak_bytes == stock_peak["Total"] > 0
    assert peak.parts["activations"] == stock_peak["Activation"] and peak.parts["gradients"] == stock_peak["Gradient"]
