"""One precision name -> what each wrapper needs: FSDP1 MixedPrecision, FSDP2 MixedPrecisionPolicy,
autocast hooks for none/dp/ddp/horovod, an input cast for bf16-true, and the grad scaler for fp16."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hydraddp.parallel.combinations import PRECISIONS
from hydraddp.parallel.trees import cast_floats


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


_AUTOCASTS = threading.local()  # per thread: DataParallel runs each replica's forward in a thread of its own


class PrecisionHooks:
    """Forward hooks that give a module its precision without touching its ``forward``.

    Before the forward: cast floating inputs to ``inputs_dtype`` (bf16-true) and enter autocast in
    ``autocast_dtype``; after it (also when it raised): leave autocast and return fp32 outputs, so the loss is
    computed in fp32. Hooks live in the module's own hook dicts: ``copy.deepcopy`` (EMA, ``AveragedModel``),
    pickling (``torch.save(model)``) and DataParallel's replicas carry them along, and each replica enters
    autocast with the right dtype in its own thread. (``torch.autocast`` state is per thread, so wrapping
    DataParallel's forward instead left the replicas in fp16, autocast's default.) A plain object, so it pickles.
    """

    def __init__(self, device_type: str, autocast_dtype: torch.dtype | None = None,
                 inputs_dtype: torch.dtype | None = None):
        self.device_type, self.autocast_dtype, self.inputs_dtype = device_type, autocast_dtype, inputs_dtype

    def before(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        if self.inputs_dtype is not None:
            args, kwargs = cast_floats(args, self.inputs_dtype), cast_floats(kwargs, self.inputs_dtype)
        if self.autocast_dtype is not None:
            context = torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)
            context.__enter__()
            _AUTOCASTS.__dict__.setdefault("stack", []).append(context)
        return args, kwargs

    def after(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        if self.autocast_dtype is not None:
            _AUTOCASTS.stack.pop().__exit__(None, None, None)
        return cast_floats(output, torch.float32)


def add_precision_hooks(module: nn.Module, spec: PrecisionSpec, device_type: str, autocast: bool) -> None:
    """Give ``module`` the precision ``spec`` asks for: autocast (when ``autocast``, for wraps that do not
    cast themselves), weights' dtype inputs for bf16-true, and fp32 outputs for every low-precision mode."""
    if not (spec.is_mixed or spec.storage_dtype != torch.float32):
        return
    hooks = PrecisionHooks(
        device_type,
        autocast_dtype=spec.compute_dtype if autocast and spec.is_mixed else None,
        inputs_dtype=spec.storage_dtype if spec.storage_dtype != torch.float32 else None,
    )
    module.register_forward_pre_hook(hooks.before, with_kwargs=True)
    module.register_forward_hook(hooks.after, with_kwargs=True, always_call=True)


def make_grad_scaler(spec: PrecisionSpec, sharded: bool, device_type: str = "cuda", **kwargs: Any):
    """The scaler fp16 needs (``ShardedGradScaler`` under FSDP), or None when the precision needs none."""
    if not spec.needs_scaler:
        return None
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device_type, **kwargs)
    return torch.amp.GradScaler(device_type, **kwargs)
