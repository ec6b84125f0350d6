"""hydraddp's distributed core: a drop-in for ignite's ``idist`` with FSDP1/FSDP2 and wrap reports.

>>> import hydraddp.distributed as idist
>>> idist.get_world_size()
1

Imports torch only (Horovod lazily); nothing of Hydra, OmegaConf or MLflow.
"""

import importlib

# Names load their module on first use (PEP 562): the compatibility rules and the launcher-env parsing are
# pure Python, so the app can validate a configuration before paying for `import torch`.
_EXPORTS = {
    "api": ("all_gather", "all_reduce", "available_backends", "backend", "barrier", "broadcast", "current",
            "device", "finalize", "get_local_rank", "get_nnodes", "get_node_rank", "get_nproc_per_node",
            "get_rank", "get_world_size", "initialize"),
    "auto": ("DistributedProxySampler", "auto_dataloader", "auto_model", "auto_optim", "grad_scaler"),
    "compat": ("BACKENDS", "OFFLOADS", "PRECISIONS", "WRAPS", "Combination", "ConfigurationError", "Problem",
               "check_compatibility", "resolve_wrap"),
    "env": ("LaunchEnv", "detect_launch_env", "free_port"),
    "horovod": ("has_hvd_support",),
    "launcher": ("Parallel", "WorkerFailedError", "worker_start_method"),
    "native": ("native_backends_available",),
    "report": ("WrapReport", "wrap_report"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'hydraddp.distributed' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hydraddp.distributed.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_MODULE_OF])


__all__ = sorted(_MODULE_OF)
