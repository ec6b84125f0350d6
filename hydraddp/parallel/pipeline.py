"""Pipeline parallel: a model cut along its blocks into stages, each rank of a pipeline group running its own stages
under one of torch's schedules (``torch.distributed.pipelining``), torchtitan's way.

- **The cut.** The model's blocks, in order, are cut into contiguous runs balanced by parameter count (the largest
  stage as small as it can be), or where the user says (``split``: the first block of each stage after the first).
- **A stage** is the model itself less what other stages hold: the blocks of the others, the embeddings unless it is
  the first, the final norm and the head unless it is the last. Every name is kept (``blocks.5.attn.qkv.weight`` on
  whichever stage holds block 5), so a checkpoint written at one pipeline degree loads at any other (DCP by name).
- **The shape it needs** (``PipelineShape``, declared by the model class as ``pipeline_shape``, e.g. the bundled GPT):
  the blocks, a ``ModuleDict`` keyed by index; the modules only the first stage holds; those only the last holds. The
  model's forward takes hidden states where those of the first are None, and returns them where those of the last are.
  A model without it is refused (``NotPipelinable``), with the reason.
- **Where stages go.** One per rank (``1F1B``, ``GPipe``); ``stages_per_rank`` per rank, looping over the ranks
  (``Interleaved1F1B``, ``LoopedBFS``, ``InterleavedZeroBubble``), or two per rank in a V (``ZBVZeroBubble``,
  ``DualPipeV``: rank 0 holds the first and the last).
- **Each stage is parallelized** by the one pipeline every wrap goes through (``parallelize``: TP over the stage's TP
  ranks, activation checkpointing, compile, then ``fully_shard`` over its data-parallel ranks): PP is cut first, as
  in torchtitan.
- **The bubble** of each step, on each rank: the share of the step this rank's stages did not compute (their
  forward and backward passes of each microbatch, timed as the schedule runs them; the rest is waiting for another
  stage, and the sends and receives). 1F1B's textbook bubble is (p - 1) / (m + p - 1) for p stages and m microbatches.
"""

from __future__ import annotations

import copy
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

SINGLE_STAGE = ("1F1B", "GPipe")
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = SINGLE_STAGE + LOOPED + V_SHAPED


class NotPipelinable(ValueError):
    """A model, a cut or a schedule that pipeline parallel cannot run, with the reason."""


@dataclass(frozen=True)
class PipelineShape:
    """Where a model's stages are cut: its blocks (a ``ModuleDict`` keyed by index, or a ``ModuleList``), the modules
    of its first stage and those of its last, by (dotted) attribute path. ``stage_forward``, when the model's own
    forward does not take hidden states where the first modules are gone: a function ``(stage, x)`` each stage runs
    instead (a Hugging Face decoder's, ``hydraddp.models.hf``)."""

    blocks: str = "blocks"
    first: tuple[str, ...] = ()
    last: tuple[str, ...] = ()
    stage_forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None


def shape_of(model: nn.Module) -> PipelineShape:
    """The model's declared ``pipeline_shape``; ``NotPipelinable`` naming what is missing."""
    # its own, or its class's: not one a wrapper forwards from the model it wraps (peft's), whose paths are not its
    shape = vars(model).get("pipeline_shape") or getattr(type(model), "pipeline_shape", None)
    name = type(model).__name__
    if not isinstance(shape, PipelineShape):
        raise NotPipelinable(f"{name} declares no pipeline_shape: pipeline parallel cuts a model whose forward is its "
                             "first modules, then a sequence of blocks, then its last modules, and needs to know them")
    blocks = _at(model, shape.blocks)
    if not (isinstance(blocks, nn.ModuleList) or
            (isinstance(blocks, nn.ModuleDict) and list(blocks) == [str(i) for i in range(len(blocks))])):
        raise NotPipelinable(f"{name}.{shape.blocks} is not a ModuleDict of blocks keyed 0, 1, ... (nor a "
                             "ModuleList): a stage keeps some of them under their own names")
    first = {id(p): path for path in shape.first for p in _at(model, path).parameters()}
    shared = [(first[id(p)], path) for path in shape.last for p in _at(model, path).parameters() if id(p) in first]
    if shared:
        raise NotPipelinable(f"{name}'s {shared[0][0]} and {shared[0][1]} share their weights (tied), and sit on the "
                             "first and the last stage; untie them (tie_word_embeddings=false)")
    return shape


def block_sizes(model: nn.Module) -> list[int]:
    """Each block's parameter count, in order (what ``cut`` balances)."""
    return [sum(p.numel() for p in block.parameters()) for block in _at(model, shape_of(model).blocks).children()]


def _at(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path)


def _set(model: nn.Module, path: str, module: nn.Module | None) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def cut(sizes: Sequence[int], stages: int, split: Sequence[int] | None = None) -> list[range]:
    """The blocks of each of ``stages`` stages (``sizes``: each block's parameter count): at ``split`` (the first
    block of stages 1, 2, ...) when given, else contiguous runs with the largest total as small as it can be."""
    count = len(sizes)
    if stages > count:
        raise NotPipelinable(f"{stages} stages need at least {stages} blocks, and the model has {count}")
    if split is not None:
        starts = [0, *split, count]
        if len(split) != stages - 1 or any(a >= b for a, b in zip(starts, starts[1:])):
            raise NotPipelinable(f"the split {list(split)} is not {stages - 1} increasing block indices in "
                                 f"1..{count - 1} (the first block of each stage after the first)")
        return [range(a, b) for a, b in zip(starts, starts[1:])]
    return _balanced(list(sizes), stages)


def _balanced(sizes: list[int], stages: int) -> list[range]:
    """The contiguous cut whose largest stage is smallest (a binary search over that largest total)."""
    def pieces(limit: int) -> list[range] | None:
        found, start, total = [], 0, 0
        for index, size in enumerate(sizes):
            if total + size > limit and index > start:
                found.append(range(start, index))
                start, total = index, 0
            total += size
        found.append(range(start, len(sizes)))
        return found if len(found) <= stages else None

    low, high = max(sizes), sum(sizes)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if pieces(middle) else (middle + 1, high)
    found = pieces(low)
    while len(found) < stages:  # fewer runs fit the limit: split the longest again, so that every stage has blocks
        longest = max(range(len(found)), key=lambda i: len(found[i]))
        run = found[longest]
        found[longest:longest + 1] = [range(run.start, run.start + 1), range(run.start + 1, run.stop)]
    return found


def stage_ids(pp_rank: int, pp: int, schedule: str, stages_per_rank: int = 1) -> list[int]:
    """The stages ``pp_rank`` of ``pp`` ranks runs under ``schedule``."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    if schedule in LOOPED:
        return [pp_rank + pp * index for index in range(stages_per_rank)]
    return [pp_rank]


def stages_per_rank_of(schedule: str, stages_per_rank: int) -> int:
    """How many stages each rank runs: 1 for the single-stage schedules, 2 for the V-shaped ones, and at least 2 for
    the looped ones (``NotPipelinable`` otherwise)."""
    if schedule not in SCHEDULES:
        raise NotPipelinable(f"pp_schedule={schedule} is not one of torch's schedules: {', '.join(SCHEDULES)}")
    if schedule in SINGLE_STAGE:
        return 1
    if schedule in V_SHAPED:
        return 2
    if stages_per_rank < 2:
        raise NotPipelinable(f"pp_schedule={schedule} runs several stages on each rank, and pp_stages_per_rank="
                             f"{stages_per_rank}; give 2 or more")
    return stages_per_rank


def stage_module(model: nn.Module, shape: PipelineShape, blocks: range, first: bool, last: bool) -> nn.Module:
    """A copy of ``model`` with only what its stage holds: ``blocks`` (a ``ModuleList``'s others set to None, a
    ``ModuleDict``'s deleted: the container stays the model's own, as a meta build's replay knows it), the first
    modules if ``first``, the last ones if ``last``. Names are kept; a stage's forward runs its blocks' ``children()``."""
    stage = copy.deepcopy(model)
    container = _at(stage, shape.blocks)
    for name in [name for name, _ in container.named_children() if int(name) not in blocks]:
        if isinstance(container, nn.ModuleDict):
            del container[name]
        else:
            setattr(container, name, None)
    for paths, held in ((shape.first, first), (shape.last, last)):
        if not held:
            for path in paths:
                _set(stage, path, None)
    if shape.stage_forward is not None:
        stage.forward = types.MethodType(shape.stage_forward, stage)
    return stage


def _merged(modules: list[nn.Module]) -> nn.Module:
    """One module holding what each of ``modules`` (copies of one model, less different parts) holds, under the same
    names: a child that several hold is merged in turn when it has children (the blocks' dict, a container), and
    taken from the first otherwise (a copy alike in each, e.g. a rotary embedding's buffers)."""
    if len(modules) == 1 or not any(True for _ in modules[0].children()):
        return modules[0]
    merged = nn.ModuleDict() if isinstance(modules[0], nn.ModuleDict) else nn.Module()  # a list's: "0", "1", ...
    for name in dict.fromkeys(name for module in modules for name, _ in module.named_children()):
        holders = [module._modules[name] for module in modules if module._modules.get(name) is not None]
        merged.add_module(name, _merged(holders))
    return merged


@dataclass
class Pipeline:
    """This rank's part of a pipeline: its stage modules (parallelized) and the schedule that runs them."""

    stages: list[nn.Module]
    stage_indices: list[int]
    num_stages: int
    schedule: Any
    group: Any  # the pipeline's process group (the ranks of one data-parallel slice, one per stage place)
    holders: dict[int, int]  # each stage's rank (global)
    computing: list[float]  # seconds this rank's stages have computed, so far (``_timed``)
    bubble: float | None = None  # the last step's bubble on this rank: the share of it not computing

    @property
    def last_stage_rank(self) -> int:
        return self.holders[self.num_stages - 1]

    @property
    def first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def last(self) -> bool:
        return self.num_stages - 1 in self.stage_indices

    def parameters(self) -> list[nn.Parameter]:
        return [p for stage in self.stages for p in stage.parameters()]

    def held(self) -> nn.Module:
        """This rank's stages as one module, under the whole model's names: the stage itself, or (the looped and
        V-shaped schedules) a module holding the modules of each of its stages, the blocks of all of them in one
        ``ModuleDict``. What the optimizer, the checkpoint and the report see: the same modules and parameters as the
        schedule runs, so a checkpoint holds each of them once, under its name in the whole model."""
        return _merged(self.stages)  # in stage order: the blocks in the model's order

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One training step's forward and backward over the microbatches of ``inputs`` (the first stage's) against
        ``targets`` (the last stage's); every rank of the pipeline gets the mean loss of the microbatches."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.first else ()
        computed, start = self.computing[0], time.perf_counter()
        self.schedule.step(*args, target=targets if self.last else None, losses=losses if self.last else None)
        elapsed = time.perf_counter() - start
        self.bubble = max(0.0, 1 - (self.computing[0] - computed) / elapsed) if elapsed > 0 else None
        loss = torch.stack([l.detach() for l in losses]).mean() if self.last else torch.zeros((), device=targets.device)
        dist.broadcast(loss, src=self.last_stage_rank, group=self.group)
        return loss


def build(model: nn.Module, pp_mesh: Any, schedule: str, microbatches: int,
          loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device,
          parallelize_stage: Callable[[nn.Module], nn.Module], *, stages_per_rank: int = 1,
          split: Sequence[int] | None = None) -> Pipeline:
    """Cut ``model`` for the ranks of ``pp_mesh`` (this rank's place in it decides its stages), parallelize each of
    this rank's stages (``parallelize_stage``), and make ``schedule`` over them."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    shape = shape_of(model)
    per_rank = stages_per_rank_of(schedule, stages_per_rank)
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    num_stages = pp * per_rank
    runs = cut(block_sizes(model), num_stages, split)
    indices = stage_ids(pp_rank, pp, schedule, per_rank)
    group = pp_mesh.get_group()
    modules, stages, computing = [], [], [0.0]
    for index in indices:
        module = parallelize_stage(stage_module(model, shape, runs[index], index == 0, index == num_stages - 1))
        modules.append(module)
        stages.append(_timed(PipelineStage(module, index, num_stages, device, group=group), computing))
    cls = get_schedule_class(schedule)
    if schedule in SINGLE_STAGE:
        runner = cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    else:
        runner = cls(stages, n_microbatches=microbatches, loss_fn=loss_fn)
    holders = {stage: dist.get_global_rank(group, rank) for rank in range(pp)
               for stage in stage_ids(rank, pp, schedule, per_rank)}
    return Pipeline(modules, indices, num_stages, runner, group, holders, computing)


COMPUTING = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")  # a stage's own work


def _timed(stage: Any, computing: list[float]) -> Any:
    """``stage`` with the time of each forward and backward pass it runs added to ``computing[0]``. (The schedule
    receives a microbatch's inputs before it calls them, and sends their outputs after: waits are not counted.)"""
    for name in COMPUTING:
        def timed(*args: Any, _run: Callable[..., Any] = getattr(stage, name), **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _run(*args, **kwargs)
            finally:
                computing[0] += time.perf_counter() - start

        setattr(stage, name, timed)
    return stage
