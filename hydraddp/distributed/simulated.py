"""A world of N ranks seen from one of them, with no memory and no peers: torch's fake process group (every
collective returns at once) and fake tensors (shapes and dtypes, no storage). ``auto_model`` wraps as it would in a
real launch, so a planner can run the real wrap and training step and count what one rank would hold.

>>> with simulated_world(world_size=8, backend="nccl") as fake:    # doctest: +SKIP
...     model = idist.auto_model(GPT(...), wrap="fsdp2")            # real fully_shard, fake tensors
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hydraddp.distributed import utils
from hydraddp.distributed.comp_models.native import _NativeDistModel, _Topology
from hydraddp.distributed.mesh import MeshShape
from hydraddp.distributed.mesh import build as build_mesh

_active: _SimulatedDistModel | None = None


class _SimulatedDistModel(_NativeDistModel):
    """The native context on the fake process group, answering with the backend the real launch would use (the
    compatibility rules are checked against that one), and holding the device mesh made before fake tensors."""

    def __init__(self, topology: _Topology, backend: str, mesh: Any):
        super().__init__(topology, owns_group=False)  # simulated_world ends the group
        self._backend, self.mesh = backend, mesh

    def backend(self) -> str:
        return self._backend

    def device(self) -> torch.device:
        return torch.device("cpu")  # the bytes per rank are the same on any device


def active() -> _SimulatedDistModel | None:
    """The simulated world being planned in, or None in a real one."""
    return _active


@contextlib.contextmanager
def simulated_world(world_size: int, backend: str = "gloo", nproc_per_node: int | None = None,
                    rank: int = 0, mesh_shape: Any = None) -> Iterator[Any]:
    """Be ``rank`` of ``world_size`` ranks under fake tensors; yields the ``FakeTensorMode``. Nothing in here may
    read a tensor's values (``.item()``, a data-dependent branch): fake tensors have none. ``mesh_shape``
    (``mesh.MeshShape``): the N-D mesh fsdp2 wraps on, made here with the group."""
    global _active
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized() or _active is not None:
        raise RuntimeError("simulated_world needs a process with no process group of its own")
    nproc = nproc_per_node or world_size
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        # The mesh reads the group's ranks: it must exist before fake tensors, which have no values to read.
        shape = MeshShape.of(mesh_shape).resolved(world_size)
        mesh = build_mesh(shape, "cpu") if shape.multi_dimensional else init_device_mesh("cpu", (world_size,))
        _active = _SimulatedDistModel(_Topology(rank % nproc, nproc, max(world_size // nproc, 1), rank // nproc),
                                      backend, mesh)
        utils._set_model(_active)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, warnings.catch_warnings(), _meshes_unfaked():
            # FSDP1 asks a flat parameter for its address once: harmless here, where nothing is read through it.
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            yield mode
    finally:
        _active = None
        utils._set_model(utils._SerialModel())
        dist.destroy_process_group()


@contextlib.contextmanager
def _meshes_unfaked() -> Iterator[None]:
    """FSDP2 over TP joins the data-parallel and TP meshes into one (``DeviceMesh._concatenate``), which finds this
    rank in the joined mesh's rank tensor: values fake tensors do not have. A mesh holds ranks, not model state, so
    it is made of real tensors here."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    concatenate = DeviceMesh._concatenate

    def real_concatenate(meshes: list[Any]) -> Any:
        with unset_fake_temporarily():
            return concatenate(meshes)

    DeviceMesh._concatenate = staticmethod(real_concatenate)
    try:
        yield
    finally:
        DeviceMesh._concatenate = staticmethod(concatenate)


class BucketedGradients(nn.Module):
    """DDP's memory, where DDP itself cannot run (its C++ reducer reads real storage): communication buckets the
    size of the gradients, made once, and each gradient copied into its bucket as backward produces it. With
    ``gradient_as_bucket_view`` the gradient then *is* its bucket slice, as DDP does it; without, the gradient
    stays and the bucket is a second copy. The all-reduce itself is in place, so it adds nothing."""

    def __init__(self, module: nn.Module, gradient_as_bucket_view: bool = False, **ignored: Any):
        super().__init__()
        self.module = module  # DDP's attribute: parameter names start with "module.", as under DDP
        self._syncing = True
        params = [p for p in module.parameters() if p.requires_grad]
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for param in params:
            by_dtype.setdefault(param.dtype, []).append(param)
        for dtype, group in by_dtype.items():
            bucket = torch.empty(sum(p.numel() for p in group), dtype=dtype, device=group[0].device)
            offset = 0
            for param in group:
                view = bucket[offset:offset + param.numel()].view_as(param)
                param.register_post_accumulate_grad_hook(self._copy_into(view, gradient_as_bucket_view))
                offset += param.numel()

    def _copy_into(self, view: torch.Tensor, as_view: bool):
        def hook(param: nn.Parameter) -> None:
            if not self._syncing:
                return
            view.copy_(param.grad)
            if as_view:
                param.grad = view

        return hook

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True
