"""A world of N ranks seen from one of them, with no memory and no peers: torch's fake process group (every
collective returns at once) and fake tensors (shapes and dtypes, no storage). ``auto_model`` wraps as it would in a
real launch, so a planner can run the real wrap and training step and count what one rank would hold.

>>> with simulated_world(world_size=8, backend="nccl") as fake:    # doctest: +SKIP
...     model = idist.auto_model(GPT(...), wrap="fsdp2")            # real fully_shard, fake tensors
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from hydraddp.distributed import utils
from hydraddp.distributed.comp_models.native import _NativeDistModel, _Topology
from hydraddp.parallel.mesh import MeshShape
from hydraddp.parallel.mesh import build as build_mesh
from hydraddp.parallel import simulation



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


active = simulation.active  # the simulated world being planned in, or None in a real one


@contextlib.contextmanager
def simulated_world(world_size: int, backend: str = "gloo", nproc_per_node: int | None = None,
                    rank: int = 0, mesh_shape: Any = None) -> Iterator[Any]:
    """Be ``rank`` of ``world_size`` ranks under fake tensors; yields the ``FakeTensorMode``. Nothing in here may
    read a tensor's values (``.item()``, a data-dependent branch): fake tensors have none. ``mesh_shape``
    (``mesh.MeshShape``): the N-D mesh fsdp2 wraps on, made here with the group."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized() or simulation.active() is not None:
        raise RuntimeError("simulated_world needs a process with no process group of its own")
    nproc = nproc_per_node or world_size
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        # The mesh reads the group's ranks: it must exist before fake tensors, which have no values to read.
        shape = MeshShape.of(mesh_shape).resolved(world_size)
        mesh = build_mesh(shape, "cpu") if shape.multi_dimensional else init_device_mesh("cpu", (world_size,))
        simulation.world = _SimulatedDistModel(
            _Topology(rank % nproc, nproc, max(world_size // nproc, 1), rank // nproc), backend, mesh)
        utils._set_model(simulation.world)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, warnings.catch_warnings(), _meshes_unfaked(), \
                _fake_modules_convertible(mode):
            # FSDP1 asks a flat parameter for its address once: harmless here, where nothing is read through it.
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            yield mode
    finally:
        simulation.world = None
        utils._set_model(utils._SerialModel())
        dist.destroy_process_group()


@contextlib.contextmanager
def _fake_modules_convertible(mode: Any) -> Iterator[None]:
    """``module.to(...)`` on a model of fake tensors: bf16-true's weight cast, and peft's ``get_peft_model``, which
    moves each adapter to its base layer's device. torch swaps a fake parameter with its converted copy
    (``swap_tensors``), which refuses a tensor the fake mode's memo holds a weak reference to, so every such call
    failed ("Couldn't swap Linear.weight"; torch 2.13 still does, see pytorch PRs 184976 and 185595). Those memo
    entries are keyed by fresh meta tensors, never looked up again: they are dropped before the swap."""
    from torch._subclasses.fake_tensor import FakeTensor

    swap, memo = torch.utils.swap_tensors, mode.fake_tensor_converter.tensor_memo

    def swap_unmemoized(t1: torch.Tensor, t2: torch.Tensor) -> None:
        for tensor in (t1, t2):
            # The keys only: a reference held to the weakref itself would keep it alive through the swap.
            keys = [ref.key for ref in weakref.getweakrefs(tensor) if isinstance(ref, weakref.KeyedRef)] \
                if isinstance(tensor, FakeTensor) else []
            for key in keys:
                if memo.get(key) is tensor:
                    del memo[key]
        swap(t1, t2)

    torch.utils.swap_tensors = swap_unmemoized
    try:
        yield
    finally:
        torch.utils.swap_tensors = swap


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
