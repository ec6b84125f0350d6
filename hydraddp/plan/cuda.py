"""What CUDA changes in a training step's peak that the simulated step (fake tensors on the CPU) does not see, counted
as the run counts it (``torch.cuda.max_memory_allocated``). Each is taken from torch's source, not fitted:

- cuBLAS's workspaces (below);
- the caching allocator's rounding: every block is a multiple of 512 bytes, or of a power-of-two division where
  ``PYTORCH_ALLOC_CONF`` asks for ``roundup_power2_divisions`` (``allocated_bytes``);
- the optimizer's kernels: on CUDA torch's optimizers default to their ``foreach`` implementation, whose
  temporaries cover every parameter at once (Adam's ``sqrt`` of the second moments), where the CPU's default loop
  holds one parameter's (``foreach_as_on_cuda``);
- the attention kernel: where CUDA's SDPA picks FlashAttention (fp16/bf16, no mask, head size up to 256), its
  backward holds an fp32 accumulator of the query gradient and the softmax's row sums beside the gradients the CPU
  kernel returns (``KernelWorkspaces``).

Autocast's weight cache needs nothing more: the simulation runs autocast itself, whose cache (a leaf fp32 weight
cast once per forward, kept until autocast exits) is the same code on every device.

cuBLAS's workspaces: torch allocates them through the same caching allocator as the tensors (``aten/src/ATen/cuda/CublasHandlePool.cpp``),
one per cuBLAS handle and stream: 32 MiB on a Hopper GPU (compute capability 9.0), 8 MiB + 128 KiB elsewhere, or what
``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT`` pairs) says; and cuBLASLt's own beside each (``CUBLASLT_WORKSPACE_SIZE``
KiB, 1 MiB by default), unless ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1`` makes it share cuBLAS's. A handle belongs to a
thread: a rank's forward and optimizer step run on its own thread, its backward on autograd's device thread, so a
training step holds two of each. On the GPT 512x4 on one H200 (tests/gpu/test_plan_gpu.py's case) this was most of
what the simulated plan missed: 85.0 MB in fp32, 110.2 MB in bf16.

The GPU's model is read from the driver's list (/proc), never from CUDA: the launcher and the plan must not create a
CUDA context.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hydraddp.parallel.machine import NVIDIA_GPUS, cuda_device_count

MiB, KiB = 1024 * 1024, 1024
HOPPER_CUBLAS_WORKSPACE = 32 * MiB  # torch's default on compute capability 9.0
OTHER_CUBLAS_WORKSPACE = 4096 * KiB * 2 + 16 * KiB * 8  # ":4096:2:16:8", torch's default elsewhere
CUBLASLT_WORKSPACE_KIB = 1024
THREADS_WITH_A_HANDLE = 2  # the rank's own thread (forward, optimizer step) and autograd's device thread (backward)
# Data-center GPUs of compute capability 9.0, by the names their drivers give (NVIDIA H100 80GB HBM3, NVIDIA H200, ...)
HOPPER_NAMES = re.compile(r"\b(GH200|H100|H200|H800|H20)\b")


def cublas_workspace_bytes(hopper: bool, env: Mapping[str, str]) -> int:
    """One cuBLAS handle's workspace, as torch sizes it."""
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    pairs = re.findall(r":(\d+):(\d+)", config or "")
    if pairs:
        return sum(int(size) * KiB * int(count) for size, count in pairs)
    return HOPPER_CUBLAS_WORKSPACE if hopper else OTHER_CUBLAS_WORKSPACE


def cublaslt_workspace_bytes(env: Mapping[str, str]) -> int:
    """One cuBLASLt handle's own workspace (none when it shares cuBLAS's)."""
    if env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "").lower() in ("1", "true", "on", "yes"):
        return 0
    size = env.get("CUBLASLT_WORKSPACE_SIZE", "")
    return (int(size) if size.isdigit() else CUBLASLT_WORKSPACE_KIB) * KiB


def workspace_bytes(hopper: bool, env: Mapping[str, str] | None = None) -> int:
    """The cuBLAS and cuBLASLt workspaces a training step holds on one GPU."""
    env = os.environ if env is None else env
    return THREADS_WITH_A_HANDLE * (cublas_workspace_bytes(hopper, env) + cublaslt_workspace_bytes(env))


def gpu_names(gpus_dir: Path = NVIDIA_GPUS) -> list[str]:
    """The models of this node's NVIDIA GPUs, from the driver's /proc entries (no CUDA context)."""
    names = []
    for information in sorted(gpus_dir.glob("*/information")) if gpus_dir.is_dir() else []:
        try:
            found = re.search(r"^Model:\s*(.+)$", information.read_text(), re.M)
        except OSError:
            continue
        if found:
            names.append(found[1].strip())
    return names


def runs_on_cuda(backend: str) -> bool:
    """Whether a launch with ``backend`` (decided) trains on CUDA devices: nccl always; one process (none) and Horovod
    where this node has a GPU, as the run picks its device."""
    return backend == "nccl" or (backend in ("none", "horovod") and cuda_device_count() > 0)


def planned_workspaces(names: list[str], env: Mapping[str, str] | None = None) -> tuple[int, int, str | None]:
    """The workspaces to plan for a GPU of this node's model (``names``: ``gpu_names()``), how many bytes more the real
    ones may be, and why, when the model is not known here (planned for another machine: the smaller, non-Hopper
    size, and the Hopper difference as the margin)."""
    if names:
        return workspace_bytes(bool(HOPPER_NAMES.search(names[0])), env), 0, None
    smaller, hopper = workspace_bytes(False, env), workspace_bytes(True, env)
    return smaller, hopper - smaller, (f"CUDA: no GPU here to read its model; cuBLAS's workspaces are planned at "
                                       f"{smaller} bytes, {hopper} on a Hopper GPU (H100, H200)")


# --- the caching allocator's rounding (c10's CUDACachingAllocator round_size, AcceleratorAllocatorConfig) ------------

MIN_BLOCK = 512  # kMinBlockSize: every block is a multiple of it
ROUNDUP_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: one divisions setting per power of two from 1 MiB to 64 GiB
_ALLOC_CONF_TOKENS = re.compile(r"[,:\[\]]|[^,:\[\]\s]+")


def roundup_power2_divisions(conf: str) -> list[int]:
    """The ``roundup_power2_divisions`` of an allocator config (``PYTORCH_ALLOC_CONF``), one per size interval, as
    torch parses it: ``roundup_power2_divisions:4`` for every size, or ``[256:1,512:2,>:8]`` (the boundaries in MiB:
    the first value up to and including its boundary's interval, each next one at its boundary, ``>`` after the
    last); 0 where none is set."""
    divisions = [0] * ROUNDUP_INTERVALS
    tokens = _ALLOC_CONF_TOKENS.findall(conf)
    for at, token in enumerate(tokens):
        if token != "roundup_power2_divisions" or tokens[at + 1:at + 2] != [":"] or at + 2 >= len(tokens):
            continue
        if tokens[at + 2] != "[":
            return [int(tokens[at + 2])] * ROUNDUP_INTERVALS
        last, first, i = 0, True, at + 3
        while i + 2 < len(tokens) and tokens[i] != "]":
            boundary, value = tokens[i], int(tokens[i + 2])
            if boundary == ">":
                divisions[last + 1:] = [value] * (ROUNDUP_INTERVALS - last - 1)
            else:
                index = min(max(int(boundary).bit_length() - 1, 0), ROUNDUP_INTERVALS - 1)
                if first:
                    divisions[:index], first = [value] * index, False
                divisions[index], last = value, index
            i += 4 if tokens[i + 3:i + 4] == [","] else 3
    return divisions


def _next_division(size: int, divisions: int) -> int:
    """roundup_power2_next_division: ``size`` up to the next of ``divisions`` equal steps between two powers of 2."""
    if size <= 4 or divisions <= 1 or size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded_down = size & ~(step - 1)
    return size if rounded_down == size else rounded_down + step


def allocated_bytes(nbytes: int, divisions: list[int] | None = None) -> int:
    """The bytes the caching allocator allocates (and ``max_memory_allocated`` counts) for a tensor of ``nbytes``;
    nothing for an empty one."""
    if nbytes == 0:
        return 0
    if nbytes < MIN_BLOCK:
        return MIN_BLOCK
    interval = min(max(nbytes.bit_length() - 1 - 20, 0), ROUNDUP_INTERVALS - 1)  # 2**20: the intervals start at 1 MiB
    division = (divisions or [0] * ROUNDUP_INTERVALS)[interval]
    if division > 1 and nbytes > MIN_BLOCK * division:
        return _next_division(nbytes, division)
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def allocator_rounding(env: Mapping[str, str] | None = None) -> Callable[[int], int]:
    """``allocated_bytes`` under this environment's allocator config (torch reads ``PYTORCH_ALLOC_CONF``, then the
    older ``PYTORCH_CUDA_ALLOC_CONF``; a launch's workers inherit it)."""
    env = os.environ if env is None else env
    divisions = roundup_power2_divisions(env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF") or "")
    return lambda nbytes: allocated_bytes(nbytes, divisions)


# --- the optimizer's kernels ----------------------------------------------------------------------------------------

def foreach_as_on_cuda(optimizer: torch.optim.Optimizer) -> None:
    """Run ``optimizer`` as torch runs it on CUDA: a group that leaves ``foreach`` to torch (None, not fused, not
    differentiable) gets the ``foreach`` kernels, as ``torch.optim.optimizer._default_to_fused_or_foreach`` decides
    for parameters on CUDA (DTensors included). The CPU's default is one parameter at a time."""
    for group in optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("fused") \
                and not group.get("differentiable"):
            group["foreach"] = True


# --- the attention kernel -------------------------------------------------------------------------------------------

def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def flash_backward_workspace(query: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """What FlashAttention-2's backward (torch's ``_flash_attention_backward``, ``mha_bwd``) allocates beside the
    gradients, for a query of shape (batch, heads, seq, head size): the softmax's row sums, and the fp32 accumulator
    of the query gradient (always: torch's copy sets ``loop = true``), with the sequence rounded to 128 and the head
    size to 32 (256 above 192)."""
    batch, heads, seq, head_size = query.shape
    seq_rounded = _round_up(seq, 128)
    head_rounded = _round_up(head_size, 32) if head_size <= 192 else 256
    return [((batch, heads, seq_rounded), torch.float32),
            ((batch, seq_rounded, heads, head_rounded), torch.float32)]


def picks_flash(query: torch.Tensor, attn_mask: Any) -> bool:
    """Whether CUDA's SDPA picks FlashAttention for this call (``sdp_utils``'s first choice on SM80 and newer):
    fp16 or bf16, no explicit mask, a head size up to 256."""
    return query.dtype in (torch.float16, torch.bfloat16) and attn_mask is None and query.shape[-1] <= 256


class KernelWorkspaces(TorchDispatchMode):
    """Inside a simulated step: holds, for the length of each attention backward, the temporaries CUDA's kernel
    would allocate beside the CPU kernel's outputs (``flash_backward_workspace``), so the tracker counts them at the
    moment they exist."""

    BACKWARD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(func) != self.BACKWARD:
            return func(*args, **kwargs)
        # (grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=None, scale=None)
        query, attn_mask = args[1], kwargs.get("attn_mask", args[8] if len(args) > 8 else None)
        held = [torch.empty(shape, dtype=dtype, device=query.device)
                for shape, dtype in flash_backward_workspace(query)] if picks_flash(query, attn_mask) else []
        out = func(*args, **kwargs)
        del held
        return out
