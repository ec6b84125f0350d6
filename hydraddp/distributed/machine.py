"""Fill a ``Combination`` with the facts of this machine (CUDA devices, bf16, MPI, Horovod) and act on it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from hydraddp.distributed.compat import Combination, ConfigurationError, check_compatibility
from hydraddp.distributed.horovod import HOROVOD, has_hvd_support


def combination(**fields: Any) -> Combination:
    """A ``Combination`` of ``fields`` plus what this machine has. Horovod is only imported when asked for."""
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    fields.setdefault("cuda_device_count", cuda)
    if "bf16_supported" not in fields and cuda and fields.get("precision") in ("bf16", "bf16-true"):
        fields["bf16_supported"] = torch.cuda.is_bf16_supported()
    fields.setdefault("has_mpi", dist.is_available() and dist.is_mpi_available())
    if "has_horovod" not in fields:
        fields["has_horovod"] = fields.get("backend") == HOROVOD and has_hvd_support()
    return Combination(**fields)


def raise_for_problems(combo: Combination, only_keys: Iterable[str] | None = None) -> None:
    """Raise ``ConfigurationError`` with every problem of ``combo`` (those touching ``only_keys``, if given)."""
    problems = check_compatibility(combo)
    if only_keys is not None:
        wanted = {combo.names.get(k, k) for k in only_keys}
        problems = [p for p in problems if wanted & set(p.keys)]
    if problems:
        raise ConfigurationError(problems)
