"""The computation models ignite's functional API reads: serial, torch.distributed, Horovod (XLA refused)."""

from typing import Any

from hydraddp.distributed.comp_models import native, xla
from hydraddp.distributed.comp_models.base import ComputationModel, _SerialModel
from hydraddp.distributed.comp_models.horovod import _HorovodDistModel
from hydraddp.distributed.comp_models.native import _NativeDistModel, has_native_dist_support
from hydraddp.distributed.comp_models.xla import has_xla_support

# Tried in this order by ``sync``: the serial model answers when no other finds a context.
def setup_available_computation_models() -> tuple[type[ComputationModel], ...]:
    """The models ``sync`` tries, serial first. Horovod's is always listed: it finds nothing unless Horovod was
    imported and initialized, and listing it never imports Horovod."""
    return (_SerialModel, _NativeDistModel, _HorovodDistModel)


registered_computation_models = setup_available_computation_models()


def __getattr__(name: str) -> Any:
    if name == "has_hvd_support":  # computed on first read: it imports Horovod
        from hydraddp.distributed.comp_models import horovod

        return horovod.has_hvd_support
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["native", "xla", "registered_computation_models", "has_native_dist_support", "has_xla_support",
           "has_hvd_support", "setup_available_computation_models", "_SerialModel", "_NativeDistModel", "_HorovodDistModel", "ComputationModel"]
