"""Fill a ``Combination`` with the facts of this machine (CUDA devices, bf16, MPI, Horovod) and act on it.

Facts are looked up only when a rule needs them, and a CPU build of torch is known to have no CUDA from its
version string, so the app rejects a bad configuration without paying for ``import torch``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hydraddp.parallel.combinations import Combination, ConfigurationError, check_compatibility


NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one entry per GPU, listed by the driver itself
AMD_GPU_NODES = Path("/sys/class/kfd/kfd/topology/nodes")  # ROCm's topology: CPUs and GPUs, a GPU has SIMD units


def _entries(visible: str) -> list[str]:
    """A ``*_VISIBLE_DEVICES`` value's devices: the runtime stops at the first invalid entry."""
    entries = []
    for entry in visible.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        entries.append(entry)
    return entries


def _visible(count: int, env: Mapping[str, str], variables: Iterable[str] = ("CUDA_VISIBLE_DEVICES",)) -> int:
    """``count`` GPUs as each set variable narrows them."""
    for variable in variables:
        visible = env.get(variable)
        if visible is not None:
            count = min(count, len(_entries(visible)))
    return count


def visible_nvidia_gpus(env: Mapping[str, str] | None = None, gpus_dir: Path = NVIDIA_GPUS) -> list[str]:
    """The NVIDIA GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` names them (its entries, else the driver's
    indices), from the driver's own listing: what a split of them between processes hands out."""
    env = os.environ if env is None else env
    count = sum(1 for _ in gpus_dir.iterdir()) if gpus_dir.is_dir() else 0
    visible = env.get("CUDA_VISIBLE_DEVICES")
    return (_entries(visible) if visible is not None else [str(i) for i in range(count)])[:count]


def _amd_gpus(nodes: Path) -> int:
    """GPUs in ROCm's KFD topology: the nodes with SIMD units (a CPU node has ``simd_count 0``)."""
    count = 0
    for properties in nodes.glob("*/properties"):
        try:
            fields = dict(line.split(None, 1) for line in properties.read_text().splitlines() if " " in line)
        except OSError:
            continue
        count += int(fields.get("simd_count", "0").strip() or 0) > 0
    return count


def cuda_device_count(env: Mapping[str, str] | None = None, gpus_dir: Path = NVIDIA_GPUS,
                      amd_nodes: Path = AMD_GPU_NODES) -> int:
    """GPUs this process could use (``torch.cuda``'s devices: NVIDIA's, or AMD's under ROCm), found without touching
    the driver: a launcher that forks its workers after ``cuInit`` hands them a GPU they cannot use. A CPU build of
    torch has none (known from its version, without importing it); on Linux the NVIDIA driver lists its GPUs in
    /proc and the AMD driver its nodes in /sys (narrowed by ROCR_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES and
    CUDA_VISIBLE_DEVICES, as ROCm narrows them); elsewhere ``torch.cuda.device_count()`` asks NVML first."""
    env = os.environ if env is None else env
    try:
        if importlib.metadata.version("torch").endswith("+cpu"):
            return 0
    except importlib.metadata.PackageNotFoundError:
        return 0
    if gpus_dir.is_dir():
        return _visible(sum(1 for _ in gpus_dir.iterdir()), env)
    if amd_nodes.is_dir():
        return _visible(_amd_gpus(amd_nodes), env, ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"))
    if sys.platform == "linux":
        return 0  # no GPU driver loaded
    import torch

    return torch.cuda.device_count()


CPU_NPROC_PER_NODE = 2  # launcher.nproc_per_node=auto without a GPU: two processes, enough to be distributed
GPU_BACKENDS = ("auto", "nccl", "horovod")  # the backends that run one process per GPU when the node has GPUs


def auto_nproc_per_node(backend: str, gpus: int | None = None) -> int:
    """``launcher.nproc_per_node=auto``, as torchrun's ``--nproc-per-node=gpu``: one process per visible GPU (after
    ``CUDA_VISIBLE_DEVICES``) under a backend that runs one per GPU; one under ``backend=none``; else
    ``CPU_NPROC_PER_NODE``. ``gpus``: the node's count when known (``cuda_device_count``)."""
    if backend == "none":
        return 1
    gpus = cuda_device_count() if gpus is None else gpus
    return gpus if gpus > 0 and backend in GPU_BACKENDS else CPU_NPROC_PER_NODE


def nproc_per_node_of(value: Any, backend: str) -> Any:
    """``launcher.nproc_per_node`` as a count: ``auto`` decided here (``auto_nproc_per_node``); any other value as it
    is (an integer, or what the validation refuses)."""
    return auto_nproc_per_node(backend) if value == "auto" else value


def rank_device_index(local_rank: int, visible: int) -> int:
    """The GPU index a rank uses among the ``visible`` ones: its local rank, or the one GPU its process sees
    (``srun --gpus-per-task=1`` gives every task a GPU of its own, which it sees as device 0)."""
    if visible == 1:
        return 0
    if 0 <= local_rank < visible:
        return local_rank
    raise RuntimeError(f"local rank {local_rank} has no GPU of its own: this process sees {visible} GPU(s). Give "
                       "every rank one (launcher.nproc_per_node at most the GPUs, or srun --gpus-per-task=1).")


CPUINFO = Path("/proc/cpuinfo")
FAST_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # the x86 instructions oneDNN's bf16 matmuls need to be fast


def cpu_has_fast_bf16(cpuinfo: Path = CPUINFO) -> bool | None:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX): without them bf16 is emulated, and slower than
    fp32. None where the CPU's flags cannot be read (not Linux)."""
    try:
        flags = next((line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines()
                      if line.startswith("flags")), None)
    except OSError:
        return None
    if flags is None:
        return None
    return any(flag in flags for flag in FAST_BF16_FLAGS)


def precision_warnings(precision: str, cuda_devices: int, fast_bf16: bool | None) -> list[str]:
    """What to say before a launch whose precision has no fast path on this machine, naming the faster choice."""
    if precision in ("bf16", "bf16-true") and cuda_devices == 0 and fast_bf16 is False:
        return [f"precision={precision} on this CPU, which has neither AVX512-BF16 nor AMX: its bf16 math is "
                "emulated and slower than fp32 (on such a CPU, experiment=gpt_fsdp2 trained at 4-10 samples/s in bf16 "
                "against 101 in fp32). precision=fp32 is the faster choice here."]
    return []


def horovod_installed() -> bool:
    """Horovod with its PyTorch extension is on disk: a look at the files, without importing torch or Horovod.
    (``horovod.has_hvd_support`` proves the extension loads; a worker that cannot load it fails clearly.)"""
    spec = importlib.util.find_spec("horovod")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(next(Path(location, "torch").glob("mpi_lib_v2*.so"), None) is not None
               for location in spec.submodule_search_locations)


def combination(**fields: Any) -> Combination:
    """A ``Combination`` of ``fields`` plus what this machine has. Horovod is only imported when asked for."""
    if "cuda_device_count" not in fields:
        fields["cuda_device_count"] = cuda_device_count()
    if "bf16_supported" not in fields and fields["cuda_device_count"] and fields.get("precision") in ("bf16", "bf16-true"):
        import torch

        fields["bf16_supported"] = torch.cuda.is_bf16_supported()
    if "has_mpi" not in fields and fields.get("backend") == "mpi":
        import torch.distributed as dist

        fields["has_mpi"] = dist.is_available() and dist.is_mpi_available()
    if "has_horovod" not in fields and fields.get("backend") == "horovod":
        fields["has_horovod"] = horovod_installed()
    return Combination(**fields)


def raise_for_problems(combo: Combination, only_keys: Iterable[str] | None = None) -> None:
    """Raise ``ConfigurationError`` with every problem of ``combo`` (those touching ``only_keys``, if given)."""
    problems = check_compatibility(combo)
    if only_keys is not None:
        wanted = {combo.names.get(k, k) for k in only_keys}
        problems = [p for p in problems if wanted & set(p.keys)]
    if problems:
        raise ConfigurationError(problems)
