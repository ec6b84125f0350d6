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
    # ignite 0.5.5's public names, from the modules ignite keeps them in.
    "utils": ("all_gather", "all_gather_tensors_with_shapes", "all_reduce", "available_backends", "backend",
              "barrier", "broadcast", "device", "finalize", "get_local_rank", "get_nnodes", "get_node_rank",
              "get_nproc_per_node", "get_rank", "get_world_size", "has_hvd_support", "has_native_dist_support",
              "has_xla_support", "hostname", "initialize", "model_name", "new_group", "one_rank_first",
              "one_rank_only", "registered_computation_models", "set_local_rank", "show_config", "spawn", "sync",
              "current"),
    "auto": ("DistributedProxySampler", "auto_dataloader", "auto_model", "auto_optim", "grad_scaler"),
    "launcher": ("Parallel",),
    # hydraddp's own.
    "hydraddp.parallel.combinations": ("BACKENDS", "OFFLOADS", "PRECISIONS", "WRAPS", "Combination", "ConfigurationError", "Problem",
               "check_compatibility", "resolve_wrap"),
    "elastic": ("WorkerFailedError", "worker_start_method"),
    "env": ("LaunchEnv", "detect_launch_env", "free_port"),
    "report": ("WrapReport", "wrap_report"),
}
# Modules ignite exposes as attributes of ``ignite.distributed``.
_SUBMODULES = {"auto", "comp_models", "launcher", "utils", "native", "xla"}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str):
    if name in ("native", "xla"):
        value = importlib.import_module(f"hydraddp.distributed.comp_models.{name}")
    elif name in _SUBMODULES:
        value = importlib.import_module(f"hydraddp.distributed.{name}")
    elif name in _MODULE_OF:
        module = _MODULE_OF[name]
        value = getattr(importlib.import_module(module if "." in module else f"hydraddp.distributed.{module}"), name)
    else:
        raise AttributeError(f"module 'hydraddp.distributed' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_MODULE_OF, *_SUBMODULES])


__all__ = sorted([*_MODULE_OF, *_SUBMODULES])
