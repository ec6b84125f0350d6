"""Workers for the torchvision tests (run by tests/helpers/spawn.run_parallel on real gloo ranks)."""

from __future__ import annotations

import torch
from torch import nn

from hydraddp.train.step import train_step
from hydraddp.train.tasks import Classification


def compute_dtypes(local_rank: int, wraps: list[str]) -> dict:
    """For each wrap, ResNet-18 under precision=bf16 through build_model: the FSDP units, and the dtype each
    BatchNorm and each convolution computes with (their weights as the forward sees them), over one training step."""
    from hydraddp.build import build_model
    from hydraddp.config.compose import compose

    out = {}
    for wrap in wraps:
        model, report = build_model(compose(["model=resnet18", f"wrap={wrap}", "precision=bf16"]))
        seen: dict[str, set[str]] = {"batchnorm": set(), "conv": set()}

        def record(kind: str):
            return lambda module, args: seen[kind].add(str(module.weight.dtype).removeprefix("torch."))

        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.register_forward_pre_hook(record("batchnorm"))
            elif isinstance(module, nn.Conv2d):
                module.register_forward_pre_hook(record("conv"))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        batch = (torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)))
        loss = train_step(model, Classification(), batch, optimizer, None, None, False)
        out[wrap] = {"units": report.units, "dtypes": {k: sorted(v) for k, v in seen.items()},
                     "loss": loss.item()}
    return out
