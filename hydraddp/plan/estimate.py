"""One rank's memory for one composed config, found by running it: the launch's own model, wrap and training step,
in a simulated world (``hydraddp.distributed.simulated``: torch's fake process group and fake tensors). Nothing is
allocated and no peer is needed, so a 1B-parameter model plans in seconds on a laptop.

What it counts is what the run measures (``hydraddp.train.metrics.TensorPeak``): the WrapReport after the first
step (parameter, gradient and optimizer-state bytes, exact), and torch's ``MemTracker`` over the second (the peak of
tensor memory, and what it was made of at that moment).
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch
from omegaconf import DictConfig
from torch import nn

from hydraddp.parallel.mesh import MeshShape
from hydraddp.plan import cuda
from hydraddp.distributed.report import ROOT

# DDP's bucket sizes (torch.nn.parallel.DistributedDataParallel's defaults): the first bucket is small so the
# first all-reduce starts early.
FIRST_BUCKET_BYTES, BUCKET_CAP_MB = 1024 * 1024, 25


@dataclass(frozen=True)
class Unit:
    """An FSDP unit (the parameters it gathers at once) or a DDP bucket (the gradients it reduces at once)."""

    name: str
    numel: int
    checkpointed: bool = False
    compiled: bool = False


@dataclass
class Estimate:
    """What one rank of one configuration holds, in bytes (``rank`` of ``world_size``)."""

    wrap: str
    precision: str
    world_size: int
    rank: int
    units: list[Unit]
    param_bytes: int  # this rank's parameters (its shards under FSDP), as stored
    grad_bytes: int
    optim_state_bytes: int
    unsharded_unit_bytes: int  # the largest units gathered at once, in the compute dtype (prefetch: two in flight)
    activation_bytes: int  # saved for backward, at the peak
    temporary_bytes: int  # everything else alive at the peak: gathered units, casts, gradients being reduced
    peak_bytes: int  # the peak of all tensor memory over a training step (on CUDA, its workspaces included)
    batch_per_rank: int
    seconds: float  # how long the estimate took
    unsure: list[str] = field(default_factory=list)  # why the peak may be off (empty: it should hold to 10%)
    peak_margin_bytes: int = 0  # how much higher the real peak may be, for the reasons in ``unsure``
    # How the model is built (hydraddp.build.build_path): "meta" (sharded, then filled module by module) or "whole".
    build: str = "whole"
    # Host bytes of the model on this rank while it is built: the whole model, or its shards plus the largest
    # module's full tensors (one module is filled at a time).
    build_bytes: int = 0
    # model.pretrained: the bytes this rank reads from storage (its own slices of every tensor, in the file's dtype).
    pretrained_read_bytes: int | None = None
    mesh: str | None = None  # fsdp2's mesh, dp_replicate x dp_shard x tp (``2x2x1``)
    notes: list[str] = field(default_factory=list)  # the WrapReport's: what the wrapping costs for nothing here
    # On CUDA: cuBLAS's workspaces, allocated beside the tensors and counted in the peak (hydraddp.plan.cuda)
    cuda_workspace_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Estimate:
        return cls(**{**data, "units": [Unit(**unit) for unit in data["units"]]})


def _unit_sizes(numel_by_name: dict[str, int], unit_names: list[str]) -> dict[str, int]:
    """Each unit's own parameters: those under its name and not under a nested unit's (the root takes the rest)."""
    innermost_first = sorted((u for u in unit_names if u != ROOT), key=len, reverse=True)
    sizes = {**dict.fromkeys(unit_names, 0), ROOT: 0}
    for param, numel in numel_by_name.items():
        sizes[next((u for u in innermost_first if param.startswith(u + ".")), ROOT)] += numel
    return {name: numel for name, numel in sizes.items() if numel or name in unit_names}


def ddp_buckets(numel_by_name: dict[str, int], element_size: int, cap_mb: float = BUCKET_CAP_MB) -> list[Unit]:
    """DDP's buckets: parameters in reverse order (the order backward produces their gradients), the first bucket up
    to 1 MiB, the others up to ``bucket_cap_mb``."""
    buckets: list[Unit] = []
    current, numel = [], 0
    for name, count in reversed(list(numel_by_name.items())):
        cap = FIRST_BUCKET_BYTES if not buckets else cap_mb * 1024 * 1024
        current.append(name)
        numel += count
        if numel * element_size >= cap:
            buckets.append(Unit(f"bucket {len(buckets)}: {current[-1]} .. {current[0]}", numel))
            current, numel = [], 0
    if current:
        buckets.append(Unit(f"bucket {len(buckets)}: {current[-1]} .. {current[0]}", numel))
    return buckets


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _read_bytes(pretrained: str, local_numel: int) -> int:
    """This rank's elements, in the stored tensors' dtype (the most common one)."""
    from collections import Counter

    from hydraddp.handoff.pretrained import kind, stored_dtypes

    dtypes = Counter(stored_dtypes(pretrained, kind(pretrained)))
    return local_numel * dtypes.most_common(1)[0][0].itemsize if dtypes else 0


def _first_batch(cfg: DictConfig) -> Any:
    """This rank's first training batch, real (a batch is small, and a sampler reads its random numbers): the data's
    own loader, split as the run splits it."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from hydraddp.build import data_mesh
    from hydraddp.config.instantiate import instantiate
    from hydraddp.train import data

    with unset_fake_temporarily():
        train_set, _ = instantiate(cfg.data.dataset, "data.dataset")
        # num_workers=0: one batch needs no loader processes.
        return next(iter(data.train_loader(train_set, cfg.data.batch_size, 0, cfg.trainer.seed, data_mesh(cfg))))


class _SampleWeighted:
    """The task, its accumulated micro-batches weighed by their samples, not by its ``loss_weight``: a fake batch
    has no values to count the tokens of (``int()`` of a fake tensor raises), and the weights change no tensor's
    size."""

    def __init__(self, task: Any):
        self._task = task

    def __getattr__(self, name: str) -> Any:
        if name == "loss_weight":
            raise AttributeError(name)
        return getattr(self._task, name)


def estimate(cfg: DictConfig, world_size: int, rank: int = 0) -> Estimate:
    """Plan ``cfg`` (composed and validated, ``backend=auto`` decided) as ``rank`` of ``world_size``."""
    from hydraddp.parallel.precision import precision_spec

    started = time.perf_counter()
    compiled = bool(cfg.trainer.compile)
    if compiled:  # fake tensors run eagerly: the plan counts the eager step (said in ``unsure``)
        cfg = copy.deepcopy(cfg)
        cfg.trainer.compile = False
    on_cuda = cuda.runs_on_cuda(cfg.backend.name)
    run = _simulate(cfg, world_size, rank, on_cuda)
    spec = precision_spec(cfg.precision.name)
    units, unsharded = _units(cfg, run, spec)
    unsure, margin = _unsure(cfg, run.wrap, units, spec, compiled)
    # cuBLAS's workspaces on the run's GPU, and a margin where its model is not known here
    workspaces, more_margin, why = cuda.planned_workspaces(cuda.gpu_names()) if on_cuda else (0, 0, None)
    unsure, margin = unsure + ([why] if why else []), margin + more_margin
    report, peak, built = run.report, run.peak, run.build
    pretrained = cfg.model.get("pretrained")
    return Estimate(
        build=built, build_bytes=report.param_bytes + run.largest_module_bytes if built == "meta" else run.whole_bytes,
        pretrained_read_bytes=_read_bytes(pretrained, report.local_numel) if pretrained else None,
        wrap=run.wrap, precision=spec.name, world_size=world_size, rank=rank,
        units=units, param_bytes=report.param_bytes, grad_bytes=report.grad_bytes,
        optim_state_bytes=report.optim_state_bytes, unsharded_unit_bytes=unsharded,
        activation_bytes=peak.parts.get("activations", 0), temporary_bytes=peak.parts.get("temporary", 0),
        peak_bytes=peak.peak_bytes + workspaces, batch_per_rank=run.batch_per_rank,
        seconds=time.perf_counter() - started, unsure=unsure, peak_margin_bytes=margin, cuda_workspace_bytes=workspaces,
        mesh=MeshShape.of(cfg.mesh).resolved(world_size).label() if run.wrap == "fsdp2" else None,
        notes=list(report.notes))


class _Simulated(NamedTuple):
    """What the simulated run of one rank saw: the model before and after wrapping, and its two steps."""

    numel_by_name: dict[str, int]  # the bare model's parameters
    build: str  # hydraddp.build.build_path
    whole_bytes: int  # the bare model's parameters and buffers
    largest_module_bytes: int  # the largest module's own parameters and buffers
    wrap: str  # the realized wrap (wrap=auto decided)
    report: Any  # the WrapReport after the first step
    peak: Any  # the TensorPeak of the second step
    batch_per_rank: int


def _simulate(cfg: DictConfig, world_size: int, rank: int, on_cuda: bool = False) -> _Simulated:
    """Build, wrap and step ``cfg``'s model as ``rank`` of ``world_size`` in a simulated world: the first step makes
    the optimizer state (as in the run), the second is measured. ``on_cuda``: as CUDA runs it (``plan.cuda``: the
    optimizer's kernels, the attention kernel's temporaries, the caching allocator's rounding)."""
    import hydraddp.distributed as idist
    from hydraddp.build import build_path, instantiate_model, pipeline_stages, wrap_model
    from hydraddp.config.instantiate import instantiate
    from hydraddp.distributed.simulated import simulated_world
    from hydraddp.parallel.machine import nproc_per_node_of
    from hydraddp.plan.stage import pipelined_step
    from hydraddp.train import tasks
    from hydraddp.train.metrics import TensorPeak
    from hydraddp.train.optim import parameter_groups
    from hydraddp.train.step import train_step

    nproc = min(nproc_per_node_of(cfg.launcher.nproc_per_node, cfg.backend.name), world_size)
    with simulated_world(world_size, cfg.backend.name, nproc, rank, mesh_shape=dict(cfg.mesh)):
        batch = _first_batch(cfg)
        bare = instantiate_model(cfg)
        numel_by_name = {name: p.numel() for name, p in bare.named_parameters()}
        built = build_path(cfg, bare)
        whole_bytes = sum(_nbytes(t) for t in (*bare.parameters(), *bare.buffers()))
        largest_module = max((sum(_nbytes(t) for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))
                              for m in bare.modules()), default=0)
        def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
            made = idist.auto_optim(instantiate(cfg.optim.optimizer, "optim.optimizer")(
                parameter_groups(model, cfg.optim.no_decay_norm_and_bias)))
            if on_cuda:
                cuda.foreach_as_on_cuda(made)
            return made

        task, trainer = _SampleWeighted(instantiate(cfg.task, "task")), cfg.trainer
        if pipeline_stages(cfg) > 1:  # this rank's stage, its schedule's microbatches in flight (plan.stage)
            model, optimizer, step = pipelined_step(cfg, bare, task, batch, world_size, make_optimizer)
            numel_by_name = {name: p.numel() for name, p in model.named_parameters()}  # the stage's, whole
        else:
            model, _ = wrap_model(cfg, bare)
            optimizer, scaler = make_optimizer(model), idist.grad_scaler(model)
            step = lambda: train_step(model, task, batch, optimizer, scaler, trainer.grad_clip, False,  # noqa: E731
                                      trainer.accumulate_grad_batches)
        step()  # the first step makes the optimizer state, as in the run
        report = idist.wrap_report(model, optimizer)
        kernels = cuda.KernelWorkspaces() if on_cuda else contextlib.nullcontext()
        with TensorPeak(model, optimizer, allocated_bytes=cuda.allocator_rounding() if on_cuda else None) as peak, \
                kernels:
            step()
        batch_per_rank = tasks.batch_size(batch)
    realized = model._hydraddp_wrap.wrap  # wrap=auto decided (DDP's stand-in reports itself as unwrapped)
    return _Simulated(numel_by_name, built, whole_bytes, largest_module, realized, report, peak, batch_per_rank)


def _units(cfg: DictConfig, run: _Simulated, spec: Any) -> tuple[list[Unit], int]:
    """The FSDP units or DDP buckets of the realized wrap, and the bytes of the units gathered at once."""
    if run.wrap in ("fsdp", "fsdp2"):
        sizes = _unit_sizes(run.numel_by_name, run.report.units)
        units = [Unit(name, numel, name in run.report.checkpointed, name in run.report.compiled)
                 for name, numel in sizes.items()]
        in_flight = sorted((u.numel for u in units), reverse=True)[:2]  # the one computing and the one prefetched
        return units, sum(in_flight) * torch.empty((), dtype=spec.compute_dtype).element_size()
    storage_size = torch.empty((), dtype=spec.storage_dtype).element_size()
    units = ddp_buckets(run.numel_by_name, storage_size, cfg.wrap.kwargs.get("bucket_cap_mb", BUCKET_CAP_MB)) \
        if run.wrap == "ddp" else [Unit(ROOT, sum(run.numel_by_name.values()))]
    return units, 0


def _unsure(cfg: DictConfig, wrap: str, units: list[Unit], spec: Any, compiled: bool) -> tuple[list[str], int]:
    """Why the planned peak may be off, and by how many bytes at most where that is known."""
    unsure, margin = [], 0
    if wrap == "fsdp" and cfg.backend.name == "gloo":
        # gloo has no reduce-scatter of its own: torch runs it as an all-reduce of a copy of the whole gathered
        # gradient, in the reduce dtype. The simulated group reduces in place.
        margin = max((u.numel for u in units), default=0) * torch.empty((), dtype=spec.reduce_dtype).element_size()
        unsure.append(f"wrap=fsdp on gloo: its reduce-scatter copies each unit's gradient, up to {margin} bytes "
                      "more than planned")
    if cfg.offload.name != "none":
        unsure.append("offload=cpu: the parameters and optimizer state counted here live in host memory")
    if compiled:
        unsure.append("trainer.compile: the compiled graphs' own buffers are not simulated (they run eagerly here)")
    return unsure, margin
