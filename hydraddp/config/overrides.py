"""Command-line overrides as users type them -> as Hydra needs them."""

from __future__ import annotations

import re

# Experiments are global deltas whose first line is a usage comment. Hydra reads a file's
# "# @package _global_" header only from the very first lines, so the package is set where the group
# is listed (conf/config.yaml: `experiment@_global_`), and `experiment=NAME` is spelled to match it.
_EXPERIMENT = re.compile(r"^([+~]{0,2})experiment(=.*)?$")


def normalize_overrides(args: list[str]) -> list[str]:
    return [_EXPERIMENT.sub(r"\1experiment@_global_\2", a) for a in args]
