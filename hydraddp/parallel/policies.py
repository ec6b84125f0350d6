"""Wrap policies: which submodules become their own FSDP units.

Policies use FSDP1's calling convention ``policy(module=, recurse=, nonwrapped_numel=)``. FSDP1 runs them
itself; for FSDP2, which has no auto-wrap, ``plan_units`` runs the same traversal and returns the names
of the modules to ``fully_shard`` (children before parents). So one policy means the same units in both.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

# Units of at least this many parameters (about 40 MB in fp32). Fewer, larger collectives win on gloo: the
# benchmark MLP (4 x 1024, 3.2M parameters) becomes one unit and trains 1.65x faster than with a fully_shard per
# Linear. A 100M-parameter model still gets a unit per 16.8M-parameter layer, which keeps its peak RSS at 0.59 of
# DDP's; one unit would be 1.3x faster there but peak at 0.84 (benchmarks/RESULTS.md).
DEFAULT_MIN_NUM_PARAMS = 10_000_000
POLICY_NAMES = ("size", "transformer", "root")
ROOT = "<root>"  # the whole model, where a name is asked for (compiled, checkpointed, a unit)

Policy = Callable[..., bool]

# Containers have no forward of their own: as an FSDP unit their parameters would never be gathered
# (torch's size policy excludes them too). MultiheadAttention reads its weights outside submodule calls.
CONTAINERS = (nn.ModuleList, nn.ModuleDict)
LEAVES = (nn.MultiheadAttention,)


def _matches(module: nn.Module, classes: tuple[type | str, ...]) -> bool:
    cls = type(module)
    for wanted in classes:
        if isinstance(wanted, type):
            if isinstance(module, wanted):
                return True
        elif wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}"):
            return True
    return False


def _block_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int, classes: tuple) -> bool:
    return True if recurse else _matches(module, classes)


def _size_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int, min_num_params: int) -> bool:
    if recurse:
        return not isinstance(module, LEAVES)
    return nonwrapped_numel >= min_num_params


def _never_containers(policy: Policy, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    if not recurse and isinstance(module, CONTAINERS):
        return False
    return policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel)


def _root_only_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    return False


def _call_seed_style(fn: Callable, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    return fn(module=module, recurse=recurse, unwrapped_params=nonwrapped_numel)


def _call_positional(fn: Callable, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    return fn(module, recurse, nonwrapped_numel)


def bridge_policy(fn: Callable) -> Policy:
    """Make a user policy callable by keyword as torch calls it, and never let it wrap a container.

    torch >= 2.x calls ``policy(module=, recurse=, nonwrapped_numel=)``; policies written to the older
    documented signature ``(module, recurse, unwrapped_params, min_num_params=...)`` raise TypeError there.
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins / C callables: nothing to inspect, call positionally
        params = {}
    if "nonwrapped_numel" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        keyword_policy = fn
    elif "unwrapped_params" in params:
        keyword_policy = functools.partial(_call_seed_style, fn)
    else:
        keyword_policy = functools.partial(_call_positional, fn)
    return functools.partial(_never_containers, keyword_policy)


def resolve_policy(
    policy: str | Callable | None = None,
    *,
    block_classes: Iterable[type | str] | None = None,
    min_num_params: int | None = None,
) -> Any:
    """A policy name or callable -> an FSDP1-style policy (or a torch policy object, passed through).

    ``None`` picks the transformer policy when ``block_classes`` is given, else the size policy.
    """
    classes = tuple(block_classes or ())
    if policy is None:
        policy = "transformer" if classes else "size"
    if callable(policy):
        # torch's own ModuleWrapPolicy/CustomPolicy objects are callable and already speak torch's convention.
        return policy if hasattr(policy, "_run_policy") else bridge_policy(policy)
    match policy:
        case "size":
            return functools.partial(_size_policy, min_num_params=int(min_num_params or DEFAULT_MIN_NUM_PARAMS))
        case "transformer":
            if not classes:
                raise ValueError("auto_wrap_policy='transformer' needs block_classes=[...] (class names or classes)")
            return functools.partial(_block_policy, classes=classes)
        case "root":
            return _root_only_policy
        case other:
            raise ValueError(f"auto_wrap_policy={other!r} is not a policy; use one of {POLICY_NAMES} or a callable")


def plan_units(root: nn.Module, policy: Policy, skip: Callable[[nn.Module], bool] = lambda m: False) -> list[str]:
    """Names of the submodules ``policy`` makes into units, children first; the root is not included.

    Modules for which ``skip`` is true (already sharded by the user) are left alone with their subtree.
    Mirrors FSDP1's ``_recursive_wrap``: a parent's size is what its wrapped children leave over.
    """
    units: list[str] = []

    def visit(module: nn.Module, name: str) -> int:
        if module is not root and skip(module):
            return 0
        total = sum(p.numel() for p in module.parameters())
        if not policy(module=module, recurse=True, nonwrapped_numel=total):
            return total
        remaining = sum(p.numel() for p in module.parameters(recurse=False))
        for child_name, child in module.named_children():
            remaining += visit(child, f"{name}.{child_name}" if name else child_name)
        is_unit = module is not root and not isinstance(module, CONTAINERS)
        if is_unit and policy(module=module, recurse=False, nonwrapped_numel=remaining):
            units.append(name)
            return 0
        return remaining

    visit(root, "")
    return units


def declared_blocks(model: nn.Module) -> tuple[str, ...]:
    """What one block of ``model`` is, as the model itself says: hydraddp's ``fsdp_block_classes``, or Hugging Face's
    ``_no_split_modules`` (a transformers model's decoder-layer classes)."""
    return tuple(getattr(model, "fsdp_block_classes", None) or getattr(model, "_no_split_modules", None) or ())


def checkpoint_blocks(model: nn.Module, classes: Iterable[type | str]) -> list[str]:
    """Wrap every block (``classes``) in torch's non-reentrant activation checkpointing: its activations are
    recomputed in the backward pass instead of kept. Call it before sharding. Returns the blocks' names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                             apply_activation_checkpointing,
                                                                             checkpoint_wrapper)

    classes = tuple(classes)
    names = [name for name, module in model.named_modules() if module is not model and _matches(module, classes)]
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda module: _matches(module, classes))
    return names


def compile_module(module: nn.Module) -> None:
    """Compile ``module``'s forward in place. Its hooks (FSDP2's all-gathers, precision casts) stay eager around
    the compiled graph, and its parameter names and state dict stay as they are (``torch.compile(module)`` would
    add an ``_orig_mod.`` level).

    Not ``module.compile()``: in torch 2.13 it hands Dynamo ``nn.Module._call_impl``, a frame in Dynamo's skip list,
    so torch's own classes (``nn.Sequential``) silently stay eager; and FSDP2's hooks inside that call break the
    graph before the forward. A function of ours is traced, and Dynamo inlines the module's forward from there.
    """
    module.forward = CompiledForward(module)


class CompiledForward:
    """A module's compiled forward, kept on the instance as a plain object that holds the module and compiles on
    first call. ``copy.deepcopy`` (EMA, ``AveragedModel``) gives the copy one that holds the copy, so the copy runs
    its own weights; pickling drops the compiled function and the unpickled module compiles again. (A closure over
    the original bound ``forward`` ran the original's weights in every copy, and did not pickle.)"""

    def __init__(self, module: nn.Module):
        self.module = module
        self._compiled: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None:
            import torch

            eager = type(self.module).forward.__get__(self.module)

            def compiled_forward(*args: Any, **kwargs: Any) -> Any:
                return eager(*args, **kwargs)

            self._compiled = torch.compile(compiled_forward)
        return self._compiled(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {"module": self.module, "_compiled": None}


def compile_blocks(model: nn.Module, classes: Iterable[type | str]) -> list[str]:
    """``compile_module`` on every block (``classes``), the outermost match only. Returns the blocks' names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    classes = tuple(classes)
    names: list[str] = []
    for name, module in model.named_modules():
        if module is model or any(name.startswith(f"{n}.") for n in names):
            continue
        # A checkpointed block is compiled with its checkpoint around it (torchtitan's order), so that Dynamo traces
        # the recomputation with the block. A compiled block inside an eager checkpoint failed its backward
        # ("Recomputed values ... have different metadata": the recomputation saved other tensors than the forward).
        block = module._checkpoint_wrapped_module if isinstance(module, CheckpointWrapper) else module
        if not _matches(block, classes):
            continue
        compile_module(module)
        names.append(name)
    return names
