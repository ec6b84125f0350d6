"""The loop's side of pipeline parallel (``mesh.pp`` > 1): the model cut into this rank's stage
(``hydraddp.parallel.pipeline``), each stage sharded by FSDP2 over its data-parallel ranks, one training step through
torch's schedule, clipping across the stages, and a forward-only pass for evaluation and the logged model.

The ranks of one pipeline read the same batch (``MeshShape.data_parallel_rank``): the first stage takes its inputs,
the last its targets, through the task's own loss. Their losses and evaluation sums are the same on each of them, and
count once (the loop's ``copies``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from hydraddp.parallel import pipeline, simulation
from hydraddp.parallel.mesh import MeshShape, build as build_mesh
from hydraddp.parallel.tp import held_tp_plan
from hydraddp.train import step
from hydraddp.train.tasks import IGNORE_INDEX

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)
HEADER = 10  # a sent tensor's header: its dtype's index, its number of dimensions, and up to 8 sizes


def build(cfg: DictConfig, model: nn.Module, task: Any, device: torch.device, world_size: int) -> pipeline.Pipeline:
    """``model`` (built alike on every rank: whole, or on the meta device, each stage then filled after sharding by
    the replay it carries) cut for this rank, each stage made parallel by ``auto_model``
    with the config's wrap, precision and blocks: sharded over the stage's data-parallel ranks (HSDP with
    ``mesh.dp_replicate``), split over its TP ranks by the entries of the TP plan that name its modules; its report
    names the whole mesh and this rank's place in it."""
    import dataclasses

    import hydraddp.distributed as idist
    from hydraddp.build import wrap_kwargs

    shape = MeshShape.of(cfg.mesh).resolved(world_size)
    planned = simulation.active()  # the plan's mesh, made before its fake tensors (which cannot make one)
    mesh = planned.mesh if planned else build_mesh(shape, device.type)

    def parallelize_stage(stage: nn.Module) -> nn.Module:
        # FSDP2 over the stage's data-parallel ranks, and TP over its TP ranks: the mesh's own dimensions by name
        meshes: dict[str, Any] = {"mesh": mesh} if cfg.wrap.name == "fsdp2" else {}
        if shape.tp > 1:
            meshes["tp_plan"] = held_tp_plan(stage, cfg.wrap.get("tp_plan"))
        stage = idist.auto_model(stage, wrap=cfg.wrap.name, precision=cfg.precision.name,
                                 activation_checkpointing=cfg.trainer.activation_checkpointing,
                                 compile=cfg.trainer.compile, **meshes, **wrap_kwargs(cfg, stage))
        stage._hydraddp_wrap = dataclasses.replace(stage._hydraddp_wrap, mesh=shape.describe())
        return stage

    return pipeline.build(model, mesh["pp"], cfg.mesh.pp_schedule, microbatches_of(cfg, shape.pp), stage_loss(task),
                          device, parallelize_stage, stages_per_rank=cfg.mesh.pp_stages_per_rank, split=split_of(cfg))


def stage_loss(task: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The last stage's loss of a microbatch: the task's, of the stage's output as the model's."""
    return lambda output, targets: task.loss(lambda _inputs: output, (None, targets))


def microbatches_of(cfg: DictConfig, pp: int) -> int:
    """``mesh.pp_microbatches``; null: one per stage, as the preflight checked."""
    return cfg.mesh.pp_microbatches or pp * pipeline.stages_per_rank_of(cfg.mesh.pp_schedule,
                                                                       cfg.mesh.pp_stages_per_rank)


def split_of(cfg: DictConfig) -> Sequence[int] | None:
    return list(cfg.mesh.pp_split) if cfg.mesh.pp_split else None


def held(pipe: pipeline.Pipeline) -> nn.Module:
    """This rank's stages as one module under the whole model's names (``Pipeline.held``), with the wrap record of
    them together: what the loop's optimizer, checkpoint and report take as the model."""
    import dataclasses

    model = pipe.held()
    if len(pipe.stages) > 1:
        records = [stage._hydraddp_wrap for stage in pipe.stages]
        trainable = [r.trainable_numel for r in records]
        model._hydraddp_wrap = dataclasses.replace(
            records[0], total_numel=sum(r.total_numel for r in records),
            trainable_numel=None if None in trainable else sum(trainable),
            checkpointed=tuple(n for r in records for n in r.checkpointed),
            compiled=tuple(n for r in records for n in r.compiled))
    return model


def train_step(pipe: pipeline.Pipeline, batch: Any, optimizer: torch.optim.Optimizer,
               grad_clip: float | None) -> torch.Tensor:
    """One optimizer step over this pipeline's ``batch`` (``(inputs, targets)``, or a token dict:
    ``inputs_and_targets``), its microbatches run by the schedule; the batch's mean loss, the same on every rank of
    the pipeline."""
    inputs, targets = inputs_and_targets(batch)
    optimizer.zero_grad()
    loss = pipe.step(inputs, targets)
    if grad_clip:
        clip(pipe, grad_clip)
    optimizer.step()
    return loss


def inputs_and_targets(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """What the first stage reads and what the last one's loss compares with: an ``(inputs, targets)`` batch as it
    is; a token dict's ``input_ids``, and its labels shifted as a causal LM's loss shifts them (the logits at t
    predict the label at t + 1; the last position predicts nothing), so that the task's loss of a tuple batch is the
    dict's own."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        mask = batch.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise TypeError("pipeline parallel runs each stage on whole sequences: a token batch with padding "
                            "(attention_mask 0) is not supported; pack the sequences instead")
        labels = batch.get("labels", batch["input_ids"])
        targets = torch.full_like(labels, IGNORE_INDEX)
        targets[:, :-1] = labels[:, 1:]
        return batch["input_ids"], targets
    raise TypeError(f"pipeline parallel trains on (inputs, targets) batches or token dicts with input_ids; got "
                    f"{type(batch).__name__}")


def clip(pipe: pipeline.Pipeline, max_norm: float) -> None:
    """Clip every stage's gradients by the norm of all of them: each rank's norm over its stages (whole across
    their shards and TP ranks), squared and added over the pipeline's ranks."""
    params = [p for p in pipe.parameters() if p.grad is not None]
    squared = step.grad_norm(params).detach().float() ** 2
    dist.all_reduce(squared, group=pipe.group)
    step.clip_by(params, max_norm, squared.sqrt())


class Forward(nn.Module):
    """The pipeline as one model for a forward pass without gradients (evaluation, the logged model's example):
    each stage runs the whole batch in turn, its output sent to the rank of the next stage, and every rank of the
    pipeline returns the last stage's output."""

    def __init__(self, pipe: pipeline.Pipeline) -> None:
        super().__init__()
        self.stages = nn.ModuleList(pipe.stages)  # for train() and eval(); the names are the stages' own elsewhere
        self._pipe = pipe

    def forward(self, inputs: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
                **_labels_and_mask: Any) -> torch.Tensor:
        """The last stage's output (logits) for ``inputs``, or a token dict's ``input_ids`` (its labels are the
        task's to compare with; ``inputs_and_targets`` refuses padding in training)."""
        inputs = inputs if inputs is not None else input_ids
        pipe, me = self._pipe, dist.get_rank()
        held = dict(zip(pipe.stage_indices, pipe.stages))
        hidden = inputs if 0 in held else None
        for index in range(pipe.num_stages):
            if pipe.holders[index] != me:
                continue
            if hidden is None:
                hidden = _receive(pipe.holders[index - 1], inputs.device)
            hidden = held[index](hidden)
            following = pipe.holders.get(index + 1)
            if following is not None and following != me:
                _send(hidden, following)
                hidden = None
        return _broadcast(hidden, pipe.last_stage_rank, pipe.group, inputs.device)


    def whole_bytes(self) -> int:
        """The whole model's parameter bytes: this rank's stages' (a DTensor counts its global size), added over the
        pipeline's ranks."""
        params = list(self.parameters())
        own = torch.tensor(sum(p.numel() * p.element_size() for p in params), dtype=torch.int64,
                           device=params[0].device if params else None)
        dist.all_reduce(own, group=self._pipe.group)
        return int(own)

    def whole_state_dict(self, stage_state: Callable[[nn.Module], dict[str, torch.Tensor]],
                         keep: bool) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict on the CPU where ``keep``: each stage's (``stage_state``, a collective over
        its data-parallel ranks), gathered over the pipeline's ranks. The stages keep the whole model's names."""
        own: dict[str, torch.Tensor] = {}
        for stage in self._pipe.stages:
            own.update(stage_state(stage))
        everyone: list[Any] = [None] * dist.get_world_size(self._pipe.group)
        dist.all_gather_object(everyone, own, group=self._pipe.group)
        return {key: value for part in everyone for key, value in part.items()} if keep else None


def _header(tensor: torch.Tensor) -> torch.Tensor:
    sizes = list(tensor.shape) + [0] * (HEADER - 2 - tensor.dim())
    return torch.tensor([DTYPES.index(tensor.dtype), tensor.dim(), *sizes], dtype=torch.int64, device=tensor.device)


def _empty(header: torch.Tensor, device: torch.device) -> torch.Tensor:
    dtype_index, dims, *sizes = header.tolist()
    return torch.empty(sizes[:dims], dtype=DTYPES[dtype_index], device=device)


def _send(tensor: torch.Tensor, to: int) -> None:
    tensor = tensor.contiguous()
    dist.send(_header(tensor), to)
    dist.send(tensor, to)


def _receive(source: int, device: torch.device) -> torch.Tensor:
    header = torch.empty(HEADER, dtype=torch.int64, device=device)
    dist.recv(header, source)
    tensor = _empty(header, device)
    dist.recv(tensor, source)
    return tensor


def _broadcast(tensor: torch.Tensor | None, source: int, group: Any, device: torch.device) -> torch.Tensor:
    header = _header(tensor) if tensor is not None else torch.empty(HEADER, dtype=torch.int64, device=device)
    dist.broadcast(header, source, group=group)
    tensor = tensor.contiguous() if tensor is not None else _empty(header, device)
    dist.broadcast(tensor, source, group=group)
    return tensor
