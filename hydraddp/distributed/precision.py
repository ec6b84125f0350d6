"""One precision name -> what each wrapper needs: FSDP1 MixedPrecision, FSDP2 MixedPrecisionPolicy,
an autocast forward for none/dp/ddp, a weight cast for bf16-true, and the grad scaler for fp16."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hydraddp.distributed.compat import PRECISIONS


@dataclass(frozen=True)
class PrecisionSpec:
    name: str
    compute_dtype: torch.dtype  # dtype of parameters during forward/backward
    reduce_dtype: torch.dtype  # dtype of gradient reduction
    storage_dtype: torch.dtype  # dtype of the parameters at rest (the optimizer's copy)
    needs_scaler: bool = False

    @property
    def is_mixed(self) -> bool:
        return self.compute_dtype != self.storage_dtype


def precision_spec(name: str | None) -> PrecisionSpec:
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    match name or "fp32":
        case "fp32":
            return PrecisionSpec("fp32", f32, f32, f32)
        case "bf16":
            # Reduce in fp32: summing bf16 gradients over ranks loses bits that fp32 keeps for free on CPU/gloo.
            return PrecisionSpec("bf16", bf16, f32, f32)
        case "fp16":
            return PrecisionSpec("fp16", f16, f32, f32, needs_scaler=True)
        case "bf16-true":
            return PrecisionSpec("bf16-true", bf16, bf16, bf16)
        case other:
            raise ValueError(f"precision={other!r} is not an option; use one of: {', '.join(PRECISIONS)}")


def fsdp1_mixed_precision(spec: PrecisionSpec):
    """FSDP1 ``MixedPrecision`` for mixed modes (None otherwise). FSDP1 keeps BatchNorm in fp32 by itself."""
    from torch.distributed.fsdp import MixedPrecision

    if not spec.is_mixed:
        return None
    return MixedPrecision(param_dtype=spec.compute_dtype, reduce_dtype=spec.reduce_dtype, buffer_dtype=spec.compute_dtype)


def fsdp2_mp_policy(spec: PrecisionSpec, output_dtype: torch.dtype | None = None):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not spec.is_mixed:
        return MixedPrecisionPolicy(output_dtype=output_dtype)
    return MixedPrecisionPolicy(param_dtype=spec.compute_dtype, reduce_dtype=spec.reduce_dtype, output_dtype=output_dtype)


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


def _patch_forward(module: nn.Module, around: Any = contextlib.nullcontext, inputs_dtype: torch.dtype | None = None) -> None:
    # Patched on the instance (as Accelerate does) so state_dict keys and the wrapper type stay as they are.
    original = module.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if inputs_dtype is not None:
            args, kwargs = _cast_floats(args, inputs_dtype), _cast_floats(kwargs, inputs_dtype)
        with around():
            out = original(*args, **kwargs)
        return _cast_floats(out, torch.float32)

    module.forward = forward


def autocast_forward(module: nn.Module, spec: PrecisionSpec, device_type: str) -> None:
    """Run ``module.forward`` under autocast and return fp32 outputs, so the loss is computed in fp32."""
    _patch_forward(module, lambda: torch.autocast(device_type=device_type, dtype=spec.compute_dtype))


def fp32_outputs(module: nn.Module) -> None:
    """Return fp32 outputs from a module that computes in low precision (FSDP1 has no output dtype)."""
    _patch_forward(module)


def low_precision_io(module: nn.Module, spec: PrecisionSpec) -> None:
    """bf16-true: cast floating inputs to the weights' dtype, return fp32 outputs."""
    _patch_forward(module, inputs_dtype=spec.storage_dtype)


def make_grad_scaler(spec: PrecisionSpec, sharded: bool, device_type: str = "cuda", **kwargs: Any):
    """The scaler fp16 needs (``ShardedGradScaler`` under FSDP), or None when the precision needs none."""
    if not spec.needs_scaler:
        return None
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device_type, **kwargs)
    return torch.amp.GradScaler(device_type, **kwargs)
