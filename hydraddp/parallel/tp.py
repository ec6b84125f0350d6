"""Tensor parallel: the model's TP plan (its own, or ``wrap.tp_plan``) made torch's ``ParallelStyle``s, applied with
``parallelize_module``, and checked before launch against ``mesh.tp`` (``tp_problems``).

Style names are transformers' (``base_model_tp_plan``): ``colwise``, ``rowwise``, ``colwise_gather_output``,
``rowwise_split_input``, ``embedding_rowwise``, ``sequence_parallel``. Every style leaves its output a plain tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from hydraddp.parallel.combinations import ConfigurationError, Problem

def _styles() -> dict[str, Callable[[], Any]]:
    """The plan's style names, as transformers' ``base_model_tp_plan`` writes them, as torch's ``ParallelStyle``s.
    Every one leaves its output a plain tensor (``use_local_output``), as the model's own code expects."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        "colwise": ColwiseParallel,  # output features split: each rank computes its heads / its hidden units
        "rowwise": RowwiseParallel,  # input features split, outputs summed over the TP group
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),  # e.g. the LM head's logits
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),  # the vocabulary split
        "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
    }


def declared_tp_plan(model: nn.Module) -> dict[str, Any] | None:
    """The model's own TP plan: its ``tp_plan`` (a mapping, or a method returning one), or a transformers model's
    ``_tp_plan`` (its class's plan plus its config's ``base_model_tp_plan``, with the base model's prefix)."""
    own = getattr(model, "tp_plan", None)
    own = own() if callable(own) else own
    return dict(own or getattr(model, "_tp_plan", None) or {}) or None


def resolve_tp_plan(model: nn.Module, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``{module pattern: ParallelStyle}`` for ``parallelize_module``: ``given`` (``wrap.tp_plan``), else the model's
    own; style names (``colwise``...) made torch's styles. A ``ConfigurationError`` when there is none, or a name is
    not a style."""
    plan = _plan_of(model, given)
    if not plan:
        raise ConfigurationError(Problem(
            ("mesh.tp", "wrap.tp_plan"),
            f"mesh.tp>1 splits each layer as the model's tensor-parallel plan says, and {type(model).__name__} "
            "declares none (no tp_plan, no transformers base_model_tp_plan).",
            "Give a plan: wrap.tp_plan='{layers.*.attn.q: colwise, layers.*.attn.out: rowwise}' (auto_model: "
            "tp_plan=...), or a tp_plan attribute on the model; or set mesh.tp=1."))
    styles = _styles()
    resolved = {}
    for pattern, style in plan.items():
        if isinstance(style, str):
            if style not in styles:
                raise ConfigurationError(Problem(
                    ("wrap.tp_plan",), f"the TP plan gives {pattern!r} the style {style!r}, which hydraddp does not "
                    "know.", f"Use one of: {', '.join(styles)}; or a torch ParallelStyle in the model's tp_plan."))
            style = styles[style]()
        resolved[pattern] = style
    return resolved


def _plan_of(model: nn.Module, given: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``given`` (``wrap.tp_plan``), else the model's own plan."""
    # str: a config's {0: colwise} (an nn.Sequential's child) comes with an int key
    return {str(key): style for key, style in given.items()} if given else declared_tp_plan(model)


def held_tp_plan(model: nn.Module, given: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The entries of ``given`` (else the model's own plan) that name a module ``model`` holds: a pipeline stage, a
    copy of the model less the blocks, embeddings or head that other stages hold, splits what it has."""
    plan = _plan_of(model, given)
    if not plan:
        return None
    names = [name for name, _ in model.named_modules()]
    return {pattern: style for pattern, style in plan.items() if any(_matches(name, pattern) for name in names)}


def apply_tp(model: nn.Module, tp_mesh: Any, plan: Mapping[str, Any]) -> None:
    """Split ``model``'s layers over ``tp_mesh`` as ``plan`` says (``parallelize_module``; ``*`` matches one name)."""
    from torch.distributed.tensor.parallel import parallelize_module

    # A parameter TP splits and FSDP then shards lives on the 2-D (dp_shard, tp) mesh; reducing its gradient norm
    # takes one all-reduce per dimension, which DTensor warns about at every step. That cost is the design's.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    parallelize_module(model, tp_mesh, dict(plan))


def tp_problems(model: nn.Module, tp: int, given: Mapping[str, Any] | None = None) -> list[Problem]:
    """What keeps ``model`` (built on the meta device is enough) from splitting ``tp`` ways: no plan, a plan entry
    that matches no module, or a size the plan splits that ``tp`` does not divide (features, vocabulary, heads and
    KV heads, and the sequence under sequence parallel)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    try:
        plan = resolve_tp_plan(model, given)
    except ConfigurationError as exc:
        return list(exc.problems)
    found: list[Problem] = []
    fix = "Choose a mesh.tp that divides it, or mesh.tp=1."
    for pattern, style in plan.items():
        modules = [(name, m) for name, m in model.named_modules() if _matches(name, pattern)]
        if not modules:
            found.append(Problem(("wrap.tp_plan",), f"the TP plan's entry {pattern!r} matches no module of "
                                 f"{type(model).__name__}.", "Name modules as model.named_modules() does."))
        for name, module in modules[:1]:  # the pattern's modules are alike (layers.*.x)
            split = _split_size(module, style, ColwiseParallel, RowwiseParallel)
            if split is not None and split[1] % tp:
                found.append(Problem(("mesh.tp",), f"mesh.tp={tp} does not divide {name}'s {split[0]} "
                                     f"({split[1]}), which the TP plan splits ({pattern}).", fix))
    config = getattr(model, "config", None)
    for source, key in [(config, "num_attention_heads"), (config, "num_key_value_heads"),
                        *((m, "heads") for m in model.modules())]:
        value = getattr(source, key, None)
        if isinstance(value, int) and value % tp:
            found.append(Problem(("mesh.tp",), f"mesh.tp={tp} does not divide the model's {key}={value}: each TP "
                                 "rank computes whole heads.", fix))
            break
    seq_len = getattr(model, "seq_len", None)
    if any(isinstance(s, SequenceParallel) for s in plan.values()) and isinstance(seq_len, int) and seq_len % tp:
        found.append(Problem(("mesh.tp", "data.seq_len"), f"mesh.tp={tp} does not divide the sequence length "
                             f"{seq_len}, which sequence parallelism splits.", fix))
    return found


def _matches(name: str, pattern: str) -> bool:
    """``parallelize_module``'s rule: the same number of dotted parts, each matched alone (``*``: one part)."""
    import fnmatch

    parts, atoms = name.split("."), pattern.split(".")
    return len(parts) == len(atoms) and all(fnmatch.fnmatch(p, a) for p, a in zip(parts, atoms))


def _split_size(module: nn.Module, style: Any, colwise: type, rowwise: type) -> tuple[str, int] | None:
    """The size ``style`` splits in ``module``: (its name, its value)."""
    if isinstance(module, nn.Linear):
        if isinstance(style, colwise):
            return "out_features", module.out_features
        if isinstance(style, rowwise):
            return "in_features", module.in_features
    if isinstance(module, nn.Embedding):
        if isinstance(style, rowwise):
            return "num_embeddings", module.num_embeddings
        if isinstance(style, colwise):
            return "embedding_dim", module.embedding_dim
    return None
