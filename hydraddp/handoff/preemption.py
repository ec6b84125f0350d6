"""A preemption as the next launch finds it: the marker the stopped launch left in its job directory (which
checkpoint it wrote, on which signal), read by the preflight of the launch that goes on from it and retired once that
one finished; and the names of the signals ``checkpoint.preempt_signals`` may give. The signals themselves are
handled in the loop (``train.preemption``)."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

MARKER = "preempted.json"  # in the job directory: the latest preemption, which the next launch there resumes from
HISTORY = "preemptions.json"  # the marker, once a launch resumed from it and finished


def signal_numbers(names: list[str]) -> list[int]:
    """``["SIGTERM", "USR2"]`` -> signal numbers; an unknown name raises ValueError naming it."""
    numbers = []
    for name in names:
        full = name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"
        number = getattr(signal, full, None)
        if not isinstance(number, signal.Signals):
            raise ValueError(f"{name!r} is not a signal name")
        numbers.append(int(number))
    return numbers


def signal_name(number: int) -> str:
    return signal.Signals(number).name


def write_marker(job_dir: Path, entry: dict[str, Any]) -> None:
    """Record a preemption in the job directory (rank 0, after the checkpoint is complete)."""
    path = Path(job_dir, MARKER)
    history = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps([*history, entry], indent=1))


def read_marker(job_dir: Path) -> list[dict[str, Any]]:
    """Every preemption of the job in ``job_dir`` not yet followed by a finished launch, oldest first."""
    path = Path(job_dir, MARKER)
    return json.loads(path.read_text()) if path.exists() else []


def checkpointed_preemptions(job_dir: Path) -> list[dict[str, Any]]:
    """The preemptions of the job in ``job_dir`` that left a checkpoint, oldest first."""
    return [e for e in read_marker(job_dir) if e.get("checkpoint")]


def resume_point(job_dir: Path) -> tuple[str | None, int]:
    """The checkpoint a launch in ``job_dir`` goes on from after a preemption (None: none), and how many
    preemptions the job has had."""
    entries = checkpointed_preemptions(job_dir)
    return (entries[-1]["checkpoint"] if entries else None), len(entries)


def retire_marker(job_dir: Path) -> None:
    """After a resumed launch finished: the preemptions become history, and a rerun starts afresh."""
    path = Path(job_dir, MARKER)
    if path.exists():
        path.replace(Path(job_dir, HISTORY))
