"""What to plan besides the config itself: every wrap at the same settings, and, for ``plan.budget_gb``, the settings
that trade speed for memory, in the order a user would try them (fastest first)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hydraddp.plan.estimate import Estimate

WRAPS = ("none", "ddp", "fsdp", "fsdp2")


@dataclass(frozen=True)
class Candidate:
    label: str
    overrides: tuple[str, ...]
    why: str  # what it trades, said when it is the one recommended


# Fastest first: no sharding; sharding that keeps the gathered parameters from forward to backward; sharding;
# recomputing the activations as well (about a third more compute).
CANDIDATES = (
    Candidate("ddp", ("wrap=ddp",), "no sharding: every rank holds the whole model, and nothing is gathered"),
    Candidate("fsdp2, no reshard after forward", ("wrap=fsdp2", "+wrap.kwargs.reshard_after_forward=false"),
              "parameters sharded, and kept gathered from forward to backward (one all-gather per unit less)"),
    Candidate("fsdp2", ("wrap=fsdp2",), "parameters, gradients and optimizer state sharded over the ranks"),
    Candidate("fsdp", ("wrap=fsdp",), "FSDP1's flat shards"),
    Candidate("fsdp2 + activation checkpointing", ("wrap=fsdp2", "trainer.activation_checkpointing=true"),
              "sharded, and each block's activations recomputed in backward instead of kept"),
    Candidate("fsdp + activation checkpointing", ("wrap=fsdp", "trainer.activation_checkpointing=true"),
              "FSDP1's flat shards, and each block's activations recomputed in backward"),
    # Slowest: at its default of a microbatch per stage, 1F1B's bubble leaves each of 2 stages idle a third of a step
    # ((p - 1) / (m + p - 1)), more than recomputing the activations costs (about a third more compute).
    Candidate("fsdp2 over 2 pipeline stages", ("wrap=fsdp2", "mesh.pp=2"),
              "the model cut in 2 stages (a rank holds half its blocks), each sharded over its data-parallel ranks"),
)


def without_wrap(overrides: list[str], checkpointing_too: bool = False) -> list[str]:
    """The user's overrides less those of the wrap (and its kwargs): another wrap brings its own. A budget's candidates
    decide activation checkpointing too."""
    dropped = ("wrap=", "wrap.", *(("trainer.activation_checkpointing",) if checkpointing_too else ()))
    return [o for o in overrides if not o.lstrip("+~").startswith(dropped)]


def without_mesh(overrides: list[str]) -> list[str]:
    """The user's overrides less the mesh's: another wrap runs on its own one-dimensional mesh."""
    return [o for o in overrides if not o.lstrip("+~").startswith("mesh.")]


@dataclass
class Choice:
    candidate: Candidate
    estimate: Estimate | None
    error: str | None = None  # why this candidate cannot run (a model without blocks cannot checkpoint them)

    def needs(self) -> int:
        """The peak, and the margin the plan is unsure of: what the budget must hold."""
        assert self.estimate is not None
        return self.estimate.peak_bytes + self.estimate.peak_margin_bytes

    def fits(self, budget_bytes: float) -> bool:
        return self.estimate is not None and self.needs() <= budget_bytes


def within_budget(overrides: list[str], budget_bytes: float,
                  plan: Callable[[list[str]], Estimate]) -> tuple[list[Choice], Choice | None]:
    """Every candidate planned, and the first (fastest) that fits, or None."""
    from hydraddp.parallel.combinations import ConfigurationError

    choices = []
    for candidate in CANDIDATES:
        try:
            choices.append(Choice(candidate, plan([*without_wrap(overrides, checkpointing_too=True),
                                                   *candidate.overrides])))
        except ConfigurationError as exc:
            choices.append(Choice(candidate, None, str(exc)))
    return choices, next((c for c in choices if c.fits(budget_bytes)), None)
