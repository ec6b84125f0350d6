"""XLA/TPU: not supported by hydraddp. The names exist, so ignite code that checks them runs; asking for the
backend fails with a clear error instead of a missing attribute."""

from __future__ import annotations

from typing import Any

XLA_TPU = "xla-tpu"
has_xla_support = False
NOT_SUPPORTED = (f"backend='{XLA_TPU}' (XLA/TPU) is not supported by hydraddp; "
                 "use 'nccl' or 'gloo', or ignite itself for TPUs")


class _XlaDistModel:
    """Stands where ignite's XLA model stands; every way in raises."""

    name = "xla-dist"
    available_backends: tuple[str, ...] = ()

    @staticmethod
    def create_from_context() -> None:
        return None

    @staticmethod
    def create_from_backend(backend: str = XLA_TPU, **kwargs: Any) -> None:
        raise ValueError(NOT_SUPPORTED)

    @staticmethod
    def spawn(*args: Any, **kwargs: Any) -> None:
        raise ValueError(NOT_SUPPORTED)
