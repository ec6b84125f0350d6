"""What CUDA adds to a training step's peak that the simulated step cannot see (fake tensors on no device), counted
as the run counts it (``torch.cuda.max_memory_allocated``): cuBLAS's workspaces.

torch allocates them through the same caching allocator as the tensors (``aten/src/ATen/cuda/CublasHandlePool.cpp``),
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
from collections.abc import Mapping
from pathlib import Path

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
