"""A search space in Hydra's override grammar, as optuna's distributions (hydra-optuna-sweeper's conventions):

- ``interval(a, b)``: a float in [a, b]; ``tag(log, interval(a, b))`` on a log scale; ``tag(int, interval(a, b))``
  an integer;
- ``range(start, stop[, step])``: an integer, ``stop`` excluded as in Python;
- ``choice(a, b, ...)`` or ``a,b,...``: one of the values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


class SpaceError(ValueError):
    """A search space that cannot be searched: the message names the override and the fix."""


@dataclass(frozen=True)
class Space:
    distributions: dict[str, Any]  # override key -> optuna distribution
    fixed: list[str]  # the overrides every trial gets as they are


def parse(overrides: list[str]) -> Space:
    """Split ``overrides`` into the searched keys and the fixed ones."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    distributions, fixed = {}, []
    for text in overrides:
        try:
            [override] = OverridesParser.create().parse_overrides([text])
        except HydraException as exc:
            raise SpaceError(f"{text!r} is not an override Hydra can read ({exc}).") from None
        if not override.is_sweep_override():
            fixed.append(text)
            continue
        distributions[override.get_key_element()] = distribution(text, override.value())
    return Space(distributions, fixed)


def distribution(text: str, sweep: Any) -> Any:
    """The optuna distribution of one sweep override (``text``, for the message)."""
    import optuna.distributions as od
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep

    tags = set(getattr(sweep, "tags", ()) or ())
    unknown = tags - {"log", "int"}
    if unknown:
        raise SpaceError(f"{text!r}: tag {', '.join(sorted(unknown))} means nothing to the search; use tag(log, ...) "
                         "or tag(int, ...).")
    try:
        if isinstance(sweep, IntervalSweep):
            low, high = sweep.start, sweep.end
            if "int" in tags:
                return od.IntDistribution(int(low), int(high), log="log" in tags)
            return od.FloatDistribution(float(low), float(high), log="log" in tags)
        if isinstance(sweep, RangeSweep):
            step = int(sweep.step)
            count = math.ceil((sweep.stop - sweep.start) / step)
            if count < 1 or step < 1:
                raise ValueError(f"range({sweep.start}, {sweep.stop}, {step}) holds no value going up")
            return od.IntDistribution(int(sweep.start), int(sweep.start + (count - 1) * step), step=step,
                                      log="log" in tags)
        if isinstance(sweep, ChoiceSweep):
            if "log" in tags or "int" in tags:
                raise ValueError("a choice has no scale: tag(log) and tag(int) go with interval()")
            return od.CategoricalDistribution(list(sweep.list))
    except ValueError as exc:
        raise SpaceError(f"{text!r} cannot be searched: {exc}.") from None
    raise SpaceError(f"{text!r}: {type(sweep).__name__} is not a search space; use interval(), range() or choice().")


def as_override(key: str, value: Any) -> str:
    """``key=value`` that Hydra reads back as ``value`` (a float stays a float, a string is quoted when it must)."""
    if isinstance(value, float):
        return f"{key}={value!r}"
    if isinstance(value, str) and any(c in value for c in " ,()[]{}='\"\\"):
        return f"{key}='{value}'"
    return f"{key}={value}"


def representative(space: Space) -> list[str]:
    """One override per searched key, at a value the trials can take (the low end, the first choice): what is
    composed and validated before any trial starts."""
    picked = []
    for key, dist in space.distributions.items():
        value = dist.choices[0] if hasattr(dist, "choices") else dist.low
        picked.append(as_override(key, value))
    return picked


def grid(space: Space) -> dict[str, list[Any]]:
    """The space as ``GridSampler`` takes it, every value of each key: a choice's, a range's."""
    found = {}
    for key, dist in space.distributions.items():
        if hasattr(dist, "choices"):
            found[key] = list(dist.choices)
        elif getattr(dist, "step", None) is not None and isinstance(dist.low, int):
            found[key] = list(range(dist.low, dist.high + 1, dist.step))
        else:
            raise SpaceError(f"hydra/sweeper/sampler=grid searches choices and ranges; {key} is an interval: give it "
                             "as choice(...) or range(...), or set hydra.sweeper.sampler.search_space.")
    return found
