"""Worker functions for the GPU tests: each runs on every rank as fn(local_rank, ...).

Results travel back to the test process by pickling, so every tensor is moved to the CPU first: a CUDA
tensor would need the worker's CUDA context, which is gone once the worker exits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import hydraddp.distributed as idist
from hydraddp.train.step import clip as clip_gradients
from tests.distributed.models import bn_net
from tests.distributed.workers import GLOBAL_BATCH, dataset, full_params, mlp, train_parity


def exact_fp32() -> None:
    # TF32 matmuls keep 10 mantissa bits, far too few for fp32 parity. "highest" is torch's default;
    # set it anyway so an environment that changed it cannot make the parity tests flaky.
    torch.set_float32_matmul_precision("highest")


def on_cpu(value: Any) -> Any:
    """The same structure with every tensor detached and on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_cpu(v) for v in value)
    return value


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # DTensor (FSDP2): this rank's shard


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 5, scaler=None,
          clip: float | None = None) -> list[float]:
    """train_parity's loop (same data, same global batch), with an optional grad scaler and the loop's own gradient
    clipping (hydraddp.train.step.clip): global mean losses."""
    loader = idist.auto_dataloader(dataset(), batch_size=GLOBAL_BATCH, shuffle=False)
    losses = []
    for _, (x, y) in zip(range(steps), loader):
        x, y = x.to(idist.device()), y.to(idist.device())
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        if scaler is None:
            loss.backward()
            if clip is not None:
                clip_gradients(model, clip)  # the loop's own
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        losses.append(idist.all_reduce(loss.item()) / idist.get_world_size())
    return losses


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return idist.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def parity_runs(local_rank: int, cases: list[tuple[str, str]]) -> dict[tuple[str, str], dict]:
    """(wrap, precision) -> train_parity's losses, full parameters and report, on the CPU."""
    exact_fp32()
    return {case: on_cpu(train_parity(local_rank, *case)) for case in cases}


def nccl_parity(local_rank: int, cases: list[tuple[str, str]]) -> dict:
    """What plain ``auto_model(model)`` does on nccl, then the parity runs in the same process group."""
    model = idist.auto_model(mlp())
    auto = {
        "type": type(model).__name__,
        "device_ids": list(getattr(model, "device_ids", None) or []),
        "device": str(idist.device()),
        "param_devices": sorted({str(p.device) for p in model.parameters()}),
        "local_rank": local_rank,
        "backend": idist.backend(),
    }
    return {"auto": auto, "runs": parity_runs(local_rank, cases)}


def dataparallel_cases(local_rank: int, cases: dict[str, dict]) -> dict[str, dict]:
    """name -> auto_model kwargs: one forward/backward on a full batch, next to a plain one-GPU model.

    One process, no collectives, so each case's error is caught and returned: one broken case must not
    hide the others' results.
    """
    exact_fp32()
    x, y = (t[:GLOBAL_BATCH].to(idist.device()) for t in dataset().tensors)
    reference = mlp().to(idist.device())
    ref_loss = nn.functional.cross_entropy(reference(x), y)
    ref_loss.backward()
    ref_grads = [p.grad for p in reference.parameters()]
    out = {}
    for name, kwargs in cases.items():
        try:
            model = idist.auto_model(mlp(), **kwargs)
            # What each replica's first Linear really computes in (autocast state is per thread).
            compute_dtypes = set()
            first_linear = next(m for m in getattr(model, "module", model).modules() if isinstance(m, nn.Linear))
            first_linear.register_forward_hook(lambda m, i, o: compute_dtypes.add(str(o.dtype)))
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            grads = [p.grad for p in model.parameters()]
            out[name] = {
                "error": None,
                "type": type(model).__name__,
                "device_ids": list(getattr(model, "device_ids", None) or []),
                "wrapper": idist.wrap_report(model).wrapper,
                "loss": loss.item(),
                "ref_loss": ref_loss.item(),
                "compute_dtypes": sorted(compute_dtypes),
                "all_grads": all(g is not None for g in grads),
                "max_grad_diff": max((g - r).abs().max().item() for g, r in zip(grads, ref_grads) if g is not None),
            }
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def offload_runs(local_rank: int, wraps: list[str]) -> dict[str, dict]:
    """wrap -> a few steps with offload="cpu" and the same steps without it, plus where the shards live."""
    exact_fp32()
    out = {}
    for wrap in wraps:
        # Clipped as the loop clips by default (trainer.grad_clip=1.0): with offload, FSDP2's gradients are CPU
        # DTensors, whose norm is all-reduced through the group's gloo side (nccl alone cannot reduce them).
        reference = idist.auto_model(mlp(), wrap=wrap)
        reference_losses = train(reference, sgd(reference), steps=3, clip=0.1)
        model = idist.auto_model(mlp(), wrap=wrap, offload="cpu")
        optimizer = sgd(model)
        losses = train(model, optimizer, steps=3, clip=0.1)
        out[wrap] = {
            "backend": idist.backend(),
            "group_backend": str(torch.distributed.get_backend()) if idist.get_world_size() > 1 else None,
            "losses": losses,
            "reference_losses": reference_losses,
            "report": idist.wrap_report(model, optimizer).to_dict(),
            "shard_devices": sorted({_local(p).device.type for p in model.parameters()}),
            "grad_devices": sorted({_local(p.grad).device.type for p in model.parameters() if p.grad is not None}),
        }
    return out


def fp16_runs(local_rank: int, wraps: list[str]) -> dict[str, dict]:
    """wrap -> fp16 with idist.grad_scaler next to fp32, on the same data: losses, parameters, scaler type."""
    exact_fp32()
    out = {}
    for wrap in wraps:
        fp32_model = idist.auto_model(mlp(), wrap=wrap)
        fp32_losses = train(fp32_model, sgd(fp32_model))
        fp32_params = on_cpu(full_params(fp32_model))
        model = idist.auto_model(mlp(), wrap=wrap, precision="fp16")
        scaler = idist.grad_scaler(model)
        losses = train(model, sgd(model), scaler=scaler)
        out[wrap] = {
            "scaler": f"{type(scaler).__module__}.{type(scaler).__qualname__}",
            "scale": float(scaler.get_scale()),
            "losses": losses,
            "fp32_losses": fp32_losses,
            "params": on_cpu(full_params(model)),
            "fp32_params": fp32_params,
            "report": idist.wrap_report(model).to_dict(),
        }
    return out


def sync_bn_run(local_rank: int, wrap: str, precision: str) -> dict:
    """auto_model(bn_net(), sync_bn=True): where the BatchNorms ended up, and 3 steps on rank-specific data.

    Each rank sees different data, so BatchNorm running statistics agree across ranks only if they were
    computed from the global batch, which is what SyncBatchNorm does.
    """
    model = idist.auto_model(bn_net(), sync_bn=True, wrap=wrap, precision=precision)
    optimizer = idist.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(idist.get_rank())
    x = torch.randn(8, 8, generator=g).to(idist.device()) + idist.get_rank()  # shift: rank means really differ
    y = torch.randint(0, 4, (8,), generator=g).to(idist.device())
    losses = []
    for _ in range(3):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    return {
        "type": type(model).__name__,
        # isinstance, not class names: fully_shard renames a module's class (SyncBatchNorm -> FSDPSyncBatchNorm).
        "synced": [isinstance(m, nn.SyncBatchNorm) for m in norms],
        "running_mean": on_cpu(norms[0].running_mean),
        "losses": losses,
        "report": idist.wrap_report(model, optimizer).to_dict(),
    }
