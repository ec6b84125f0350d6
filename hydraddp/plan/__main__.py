"""python -m hydraddp.plan [--json FILE] [overrides]: the wrap plan and one rank's memory for the config a launch with
the same overrides would run, the same for every other wrap, and with ``plan.budget_gb=N`` what fits.

    python -m hydraddp.plan experiment=gpt_fsdp2 launcher.nproc_per_node=8
    python -m hydraddp.plan model=hf_causal_lm launcher.nproc_per_node=4 plan.budget_gb=24

No process group is started and no parameter is allocated: the config's own model, wrap and training step run in a
simulated world (torch's fake process group, fake tensors). Exit codes as for a launch: 2 for a config that would not
start, and for a budget nothing fits.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hydraddp.exit_codes import EXIT_INVALID
from hydraddp.plan.choose import WRAPS, within_budget, without_mesh, without_wrap
from hydraddp.plan.estimate import Estimate

GIB = 1024**3


def size(nbytes: float) -> str:
    """Binary units throughout (the memory plots and tables say the same)."""
    for unit, scale in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


def plan_overrides(overrides: list[str]) -> Estimate:
    """Compose and validate as a launch does, then estimate rank 0. Raises ConfigurationError for a config that would
    not start. The table and the budget ask for some configs twice: each is planned once."""
    key = tuple(overrides)
    if key not in _plans:
        cfg = _validated(key)
        _plans[key] = _estimate(cfg, _world_size(cfg))
    return _plans[key]


_plans: dict[tuple[str, ...], Estimate] = {}  # by overrides: each config is planned once per command


def _validated(overrides: tuple[str, ...]):
    """The composed config, checked as a launch checks it (a pretrained config.json's sizes too), or
    ConfigurationError."""
    from hydraddp.config.compose import compose
    from hydraddp.parallel.combinations import ConfigurationError
    from hydraddp.preflight import config_problems

    cfg = compose(list(overrides))
    found = config_problems(cfg, list(overrides))
    if found:
        raise ConfigurationError(found)
    return cfg


def _world_size(cfg) -> int:
    from hydraddp.preflight.settings import world_size

    return world_size(cfg)


class NotPlanned(Exception):
    """The simulated world could not run this config (its row says why)."""


_planned_here = {"multi_dimensional": False}  # whether this process has simulated a world with an N-D mesh


def _estimate(cfg, world: int) -> Estimate:
    """``estimate`` here, or, for an N-D mesh after another, in a process of its own. Torch caches DTensor's work by
    mesh, and meshes of two fake worlds can be *equal* (the same ranks, the same names): the caches would hand back
    the earlier world's meshes, whose groups are gone."""
    from hydraddp.parallel.mesh import MeshShape
    from hydraddp.plan.estimate import estimate

    multi = cfg.wrap.name == "fsdp2" and MeshShape.of(cfg.mesh).resolved(world).multi_dimensional
    if not (multi and _planned_here["multi_dimensional"]):
        _planned_here["multi_dimensional"] |= multi
        return estimate(cfg, world)
    return _estimate_elsewhere(cfg, world)


def _estimate_elsewhere(cfg, world: int) -> Estimate:
    """``estimate`` in a process of its own (``hydraddp.plan.record``); NotPlanned when it cannot run there."""
    from omegaconf import OmegaConf

    from hydraddp.plan.record import plan_elsewhere

    plan = plan_elsewhere(OmegaConf.to_container(cfg, resolve=True), world)
    if "error" in plan:
        raise NotPlanned(plan["error"])
    return Estimate.from_dict(plan)


def render(est: Estimate, model: str) -> str:
    lines = [f"hydraddp plan: wrap={est.wrap} precision={est.precision}, rank {est.rank} of {est.world_size}, "
             f"batch {est.batch_per_rank} per rank",
             f"  model {model}: {sum(u.numel for u in est.units):,} parameters", ""]
    kind = "FSDP units" if est.wrap in ("fsdp", "fsdp2") else ("DDP buckets" if est.wrap == "ddp" else "unwrapped")
    lines.append(f"wrap plan: {len(est.units)} {kind}")
    width = max(len(u.name) for u in est.units) if est.units else 10
    for unit in est.units:
        marks = ", ".join(m for m, on in (("activation checkpointing", unit.checkpointed), ("compiled", unit.compiled)) if on)
        lines.append(f"  {unit.name:<{width}}  {unit.numel:>14,}  {marks}".rstrip())
    lines += ["", f"memory of rank {est.rank} (peak over a training step; tensors only)"]
    parts = [("parameters", est.param_bytes), ("gradients", est.grad_bytes), ("optimizer state", est.optim_state_bytes),
             ("largest units gathered at once", est.unsharded_unit_bytes), ("activations at the peak", est.activation_bytes),
             ("other tensors at the peak", est.temporary_bytes),
             *([("cuBLAS workspaces (CUDA)", est.cuda_workspace_bytes)] if est.cuda_workspace_bytes else []),
             ("peak", est.peak_bytes)]
    lines += [f"  {name:<32}{size(value):>12}" for name, value in parts]
    lines += [f"  unsure: {reason}" for reason in est.unsure]
    lines += [f"  note: {note}" for note in est.notes]
    how = ("on the meta device, then its shards filled one module at a time" if est.build == "meta"
           else "whole, on every rank")
    lines += ["", f"build: {how}: {size(est.build_bytes)} of host memory for the model on rank {est.rank}"]
    if est.pretrained_read_bytes is not None:
        lines.append(f"model.pretrained: rank {est.rank} reads {size(est.pretrained_read_bytes)} (its own slices)")
    return "\n".join(lines)


Row = tuple[str, "Estimate | None", "str | None"]  # (what it is, its estimate or None, why it cannot run)


def render_table(rows: list[Row], current: str, heading: str = "every wrap, at the same settings (per rank)",
                 column: str = "wrap") -> str:
    width = max(8, *(len(label) + 2 for label, _, _ in rows))
    lines = ["", heading, f"  {column:<{width}}{'params':>12}{'grads':>12}{'optim':>12}{'activations':>13}{'peak':>12}"]
    for label, est, error in rows:
        mark = "  <- this config" if label == current else ""
        if est is not None and est.peak_margin_bytes:
            mark += f"  (may be up to {size(est.peak_margin_bytes)} more: {est.unsure[0].split(':')[0]})"
        if est is None:
            lines.append(f"  {label:<{width}}  cannot run: {error}")
            continue
        lines.append(f"  {label:<{width}}{size(est.param_bytes):>12}{size(est.grad_bytes):>12}"
                     f"{size(est.optim_state_bytes):>12}{size(est.activation_bytes):>13}{size(est.peak_bytes):>12}{mark}")
    return "\n".join(lines)


def _row(label: str, overrides: list[str]) -> Row:
    from hydraddp.parallel.combinations import ConfigurationError

    try:
        return label, plan_overrides(overrides), None
    except ConfigurationError as exc:
        return label, None, str(exc).strip("- \n")
    except NotPlanned as exc:
        return label, None, str(exc)


# A plan that took this long is worth spreading the table's other rows over the cores, each in a process of its own
# (a 70B-sized Llama: 19 s for its own plan, 31 s more for the three other wraps one after another, on 2 cores). Below
# it, a process's start (importing torch) would cost more than it saves.
SPREAD_AFTER_S = 5.0


def _spread(rows: dict[str, list[str]]) -> None:
    """Plan ``rows`` (label: overrides) at once, on every core, into the plan cache: each composed and checked here
    (Hydra's composition is not thread-safe), then simulated in a process of its own."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from hydraddp.parallel.combinations import ConfigurationError

    todo = {}
    for overrides in rows.values():
        try:
            todo[tuple(overrides)] = _validated(tuple(overrides))
        except ConfigurationError:
            continue  # its row says why (``_row``)
    with ThreadPoolExecutor(max_workers=max(1, min(len(todo), os.cpu_count() or 1))) as pool:
        futures = {key: pool.submit(_estimate_elsewhere, cfg, _world_size(cfg)) for key, cfg in todo.items()}
    for key, future in futures.items():
        if future.exception() is None:
            _plans[key] = future.result()


def every_wrap(overrides: list[str], est: Estimate) -> list[Row]:
    """Every wrap at the config's other settings; the others on their own one-dimensional mesh."""
    others = {wrap: [*without_wrap(without_mesh(overrides)), f"wrap={wrap}"] for wrap in WRAPS if wrap != est.wrap}
    if est.seconds >= SPREAD_AFTER_S:
        _spread(others)
    return [(wrap, est, None) if wrap == est.wrap else _row(wrap, others[wrap]) for wrap in WRAPS]


def mesh_shapes(world_size: int, nproc_per_node: int, nnodes: int) -> list[tuple[int, int]]:
    """(dp_replicate, tp) worth comparing: TP of every degree within a node, each without and with replicas (one per
    node across nodes, else two)."""
    replicas = nnodes if nnodes > 1 else 2
    return [(replicate, tp) for tp in range(1, nproc_per_node + 1) if nproc_per_node % tp == 0
            for replicate in (1, replicas) if world_size % (replicate * tp) == 0 and replicate * tp <= world_size]


def pipeline_degrees(cfg, world_size: int) -> list[int]:
    """The pipeline degrees worth comparing: 2, 4, ... that divide the world size and that the model's blocks fill;
    none for a model that declares no pipeline shape."""
    from hydraddp.models.of_config import model_of
    from hydraddp.parallel.pipeline import NotPipelinable, block_sizes

    try:
        blocks = len(block_sizes(model_of(cfg.model)))
    except NotPipelinable:
        return []
    return [pp for pp in (2, 4, 8) if world_size % pp == 0 and pp <= min(world_size, blocks)]


def every_mesh(overrides: list[str], est: Estimate, cfg) -> list[Row]:
    """fsdp2 on each mesh of ``mesh_shapes``, and each stage of a pipeline of ``pipeline_degrees`` (pp x dp_shard:
    the plan of rank 0, the first stage), at the config's other settings (the config's own mesh as planned)."""
    from hydraddp.parallel.mesh import MeshShape

    meshes = [(f"{replicate}x{est.world_size // (replicate * tp)}x{tp}",
               [f"mesh.dp_replicate={replicate}", "mesh.dp_shard=-1", f"mesh.tp={tp}"])
              for replicate, tp in mesh_shapes(est.world_size, min(cfg.launcher.nproc_per_node, est.world_size),
                                               cfg.launcher.nnodes)]
    meshes += [(MeshShape(1, -1, 1, pp).resolved(est.world_size).label(), [f"mesh.pp={pp}", "mesh.dp_shard=-1"])
               for pp in pipeline_degrees(cfg, est.world_size)]
    return [(label, est, None) if label == est.mesh else _row(label, [*without_mesh(overrides), *shape])
            for label, shape in meshes]


def budget(overrides: list[str], budget_gb: float, out: dict) -> int:
    """Print what fits ``budget_gb`` per rank and the one to use (into ``out`` too); exit 2 when nothing fits."""
    choices, best = within_budget(overrides, budget_gb * GIB, plan_overrides)
    print(f"\nplan.budget_gb={budget_gb:g}: per rank, {size(budget_gb * GIB)}")
    for choice in choices:
        verdict = ("fits" if choice.fits(budget_gb * GIB) else "too big") if choice.estimate else "cannot run"
        print(f"  {verdict:<10} {choice.candidate.label:<36} {size(choice.needs()) if choice.estimate else choice.error}")
    out["budget"] = {"budget_gb": budget_gb, "choices": [
        {"label": c.candidate.label, "overrides": list(c.candidate.overrides), "fits": c.fits(budget_gb * GIB),
         "needs_bytes": c.needs() if c.estimate else None, "error": c.error} for c in choices]}
    if best is None:
        smallest = min((c for c in choices if c.estimate), key=lambda c: c.needs(), default=None)
        need = f"; the smallest needs {size(smallest.needs())} ({' '.join(smallest.candidate.overrides)})" if smallest else ""
        print(f"hydraddp.plan: plan.budget_gb={budget_gb:g}: nothing fits{need}. Raise the budget, add ranks "
              "(launcher.nproc_per_node, launcher.nnodes), or lower data.batch_size.", file=sys.stderr)
        return EXIT_INVALID
    out["budget"]["recommended"] = list(best.candidate.overrides)
    print(f"recommended: {' '.join(best.candidate.overrides)}: {best.candidate.why}; peak "
          f"{size(best.estimate.peak_bytes)} of {size(budget_gb * GIB)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hydraddp.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="also write the plan here, as JSON")
    parser.add_argument("overrides", nargs="*", help="hydraddp overrides, as for python -m hydraddp")
    args = parser.parse_args(argv)

    from omegaconf import OmegaConf

    from hydraddp.config.compose import compose
    from hydraddp.parallel.combinations import ConfigurationError
    from hydraddp.parallel.machine import cpu_has_fast_bf16, precision_warnings
    from hydraddp.parallel.mesh import MeshShape

    try:
        cfg = compose(args.overrides)
        est = plan_overrides(args.overrides)
    except ConfigurationError as exc:
        print(f"hydraddp.plan: invalid configuration; nothing was planned:\n{exc}", file=sys.stderr)
        return EXIT_INVALID
    except Exception as exc:  # Hydra's composition errors: an unknown option, a misspelled key, a wrong type
        if type(exc).__module__.startswith(("hydra", "omegaconf")):
            print(f"hydraddp.plan: invalid configuration: {exc}", file=sys.stderr)
            return EXIT_INVALID
        raise
    print(render(est, str(cfg.model.get("_target_", "?"))))
    for warning in precision_warnings(cfg.precision.name, 0, cpu_has_fast_bf16()):
        print(f"  warning: {warning}")
    rows = every_wrap(args.overrides, est)
    print(render_table(rows, est.wrap))
    out = {"plan": est.to_dict(), "wraps": {w: e.to_dict() for w, e, _ in rows if e is not None}}
    several_meshes = est.wrap == "fsdp2" and est.world_size > 1
    if several_meshes and not MeshShape.of(cfg.mesh).multi_dimensional:
        print("\nother meshes: add mesh.tp=2 (tensor parallel), mesh.dp_replicate=2 (HSDP) or mesh.pp=2 (pipeline "
              "stages) to compare every mesh")
    elif several_meshes:
        meshes = every_mesh(args.overrides, est, cfg)
        print(render_table(meshes, est.mesh, "every mesh under fsdp2 (dp_replicate x dp_shard x tp; pp x dp_replicate "
                           "x dp_shard x tp with pipeline stages: rank 0's, the first stage), per rank", "mesh"))
        out["meshes"] = {m: e.to_dict() for m, e, _ in meshes if e is not None}
    budget_gb = OmegaConf.select(cfg, "plan.budget_gb")
    code = budget(args.overrides, budget_gb, out) if budget_gb else 0
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return code


if __name__ == "__main__":
    from hydraddp.exit_codes import exit_without_teardown

    exit_without_teardown(main)
