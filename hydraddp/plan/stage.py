"""A pipelined rank's training step as the plan simulates it: this rank's stage, cut and parallelized as the launch
does it (``train.pipelined.build``), runs its microbatches' forward and backward passes in its schedule's order
(torch's ``Schedule1F1B``: min(m, p - s) forwards on stage s of p, then a backward and a forward in turn; GPipe: every
forward, then every backward), then the optimizer step. So it holds what the run holds at its peak: the activations
of the microbatches in flight, and from the first backward on, the gradients. The stage's inputs and its outputs'
gradients come from its neighbours in the run, into buffers torch's stages allocate at the first step and reuse:
here too they are made at the first step and reused."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from hydraddp.parallel import pipeline

PLANNED_SCHEDULES = pipeline.SINGLE_STAGE  # one stage per rank; the looped and V-shaped ones interleave theirs


def order(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """``("F", k)`` and ``("B", k)`` in the order ``stage`` of ``stages`` runs them under ``schedule``."""
    if schedule == "GPipe":
        return [("F", k) for k in range(microbatches)] + [("B", k) for k in range(microbatches)]
    warmup = min(microbatches, stages - stage)
    steps = [("F", k) for k in range(warmup)]
    for k in range(microbatches):
        steps.append(("B", k))
        if warmup + k < microbatches:
            steps.append(("F", warmup + k))
    return steps


def pipelined_step(cfg: DictConfig, bare: nn.Module, task: Any, batch: Any, world_size: int,
                   make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
                   ) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """This rank's stage of ``bare`` (built in the simulated world), its optimizer, and one training step of it on
    ``batch`` (this pipeline's): what ``plan.estimate`` measures as it measures any other wrap's step."""
    from hydraddp.train import pipelined

    schedule = cfg.mesh.pp_schedule
    if schedule not in PLANNED_SCHEDULES:
        raise ValueError(f"mesh.pp_schedule={schedule}: the plan simulates {' and '.join(PLANNED_SCHEDULES)} (one "
                         "stage per rank)")
    pipe = pipelined.build(cfg, bare, task, torch.device("cpu"), world_size)
    [stage], [index] = pipe.stages, pipe.stage_indices
    model = pipelined.held(pipe)
    optimizer = make_optimizer(model)
    microbatches = pipelined.microbatches_of(cfg, cfg.mesh.pp)
    inputs, targets = (part.tensor_split(microbatches) for part in pipelined.inputs_and_targets(batch))
    received = _received(cfg, bare, inputs, index, pipe.num_stages) if index > 0 else list(inputs)
    steps, loss = order(schedule, index, pipe.num_stages, microbatches), pipelined.stage_loss(task)
    gradients: dict[int, torch.Tensor] = {}  # the output gradients' buffers, made at the first step

    def step() -> None:
        optimizer.zero_grad()
        outputs: dict[int, torch.Tensor] = {}
        for kind, k in steps:
            if kind == "F":
                output = stage(received[k])
                outputs[k] = loss(output, targets[k]) if pipe.last else output
            elif pipe.last:
                outputs.pop(k).backward()
            else:
                output = outputs.pop(k)
                output.backward(gradients.setdefault(k, torch.ones_like(output)))
        optimizer.step()

    return model, optimizer, step


def _received(cfg: DictConfig, bare: nn.Module, microbatches: tuple[torch.Tensor, ...], index: int,
              stages: int) -> list[torch.Tensor]:
    """What stage ``index`` receives for each microbatch: the output of the stages before it (their copies of the
    bare model, run without gradients), as a buffer that takes a gradient."""
    from hydraddp.train import pipelined

    shape = pipeline.shape_of(bare)
    runs = pipeline.cut(pipeline.block_sizes(bare), stages, pipelined.split_of(cfg))
    before = [pipeline.stage_module(bare, shape, runs[j], j == 0, False) for j in range(index)]
    found = []
    with torch.no_grad():
        for hidden in microbatches:
            for piece in before:
                hidden = piece(hidden)
            found.append(torch.empty_like(hidden).requires_grad_())
    return found
