"""Command-line overrides as users type them -> as Hydra needs them."""

from __future__ import annotations

import re

# Experiments are global deltas whose first line is a usage comment. Hydra reads a file's
# "# @package _global_" header only from the very first lines, so the package is set where the group
# is listed (conf/config.yaml: `experiment@_global_`), and `experiment=NAME` is spelled to match it.
_EXPERIMENT = re.compile(r"^([+~]{0,2})experiment(=.*)?$")


# Nodes whose ``_target_`` picks a class: a new target starts a new node. Without this, ``model._target_=my.Net``
# would keep the MLP's constructor keys (hidden, num_classes, ...) and my.Net would get them.
REPLACEABLE = ("model", "task")


def _replacing(args: list[str], node: str) -> bool:
    """A new ``node._target_`` given without choosing one of the group's options (``model=gpt``)."""
    target = re.compile(rf"^\+{{0,2}}{node}\._target_=")
    return any(target.match(a) for a in args) and not any(re.match(rf"^{node}=", a) for a in args)


def normalize_overrides(args: list[str]) -> list[str]:
    args = [_EXPERIMENT.sub(r"\1experiment@_global_\2", a) for a in args]
    for node in REPLACEABLE:
        if not _replacing(args, node):
            continue
        keys = re.compile(rf"^\+{{0,2}}({node}\..*)$")
        first = next(i for i, a in enumerate(args) if keys.match(a))
        # ~node drops the group's option, so the node holds only what the command line gives it (++: add or set).
        args = [*args[:first], f"~{node}", *(keys.sub(r"++\1", a) for a in args[first:])]
    return args
