"""hydraddp's distributed core: a drop-in for ignite's ``idist`` with FSDP1/FSDP2 and wrap reports.

>>> import hydraddp.distributed as idist
>>> idist.get_world_size()
1

Imports torch only (Horovod lazily); nothing of Hydra, OmegaConf or MLflow.
"""

from hydraddp.distributed.api import (
    all_gather,
    all_reduce,
    available_backends,
    backend,
    barrier,
    broadcast,
    current,
    device,
    finalize,
    get_local_rank,
    get_nnodes,
    get_node_rank,
    get_nproc_per_node,
    get_rank,
    get_world_size,
    initialize,
)
from hydraddp.distributed.auto import DataLoader, auto_dataloader, auto_model, auto_optim, grad_scaler
from hydraddp.distributed.compat import (
    BACKENDS,
    OFFLOADS,
    PRECISIONS,
    WRAPS,
    Combination,
    ConfigurationError,
    Problem,
    check_compatibility,
    resolve_wrap,
)
from hydraddp.distributed.env import LaunchEnv, detect_launch_env, free_port
from hydraddp.distributed.horovod import has_hvd_support
from hydraddp.distributed.launcher import Parallel, WorkerFailedError
from hydraddp.distributed.native import native_backends_available
from hydraddp.distributed.report import WrapReport, wrap_report

__all__ = [
    "BACKENDS", "OFFLOADS", "PRECISIONS", "WRAPS", "Combination", "ConfigurationError", "DataLoader", "LaunchEnv",
    "Parallel", "Problem", "WorkerFailedError", "WrapReport", "all_gather", "all_reduce", "auto_dataloader",
    "auto_model", "auto_optim", "available_backends", "backend", "barrier", "broadcast", "check_compatibility",
    "current", "detect_launch_env", "device", "finalize", "free_port", "get_local_rank", "get_nnodes",
    "get_node_rank", "get_nproc_per_node", "get_rank", "get_world_size", "grad_scaler", "has_hvd_support",
    "initialize", "native_backends_available", "resolve_wrap", "wrap_report",
]
