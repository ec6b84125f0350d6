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
