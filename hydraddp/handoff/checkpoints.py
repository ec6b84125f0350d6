"""A checkpoint root as a launch finds it: its complete checkpoints, which launch wrote each, the one a resume
starts from, and whether one is readable and holds a given model. What the preflight judges before a launch and what
the loop writes and loads (``train.checkpoint``) agree through these.

A checkpoint is a directory ``step_NNNNNNNN`` with ``meta.json`` (written last: a directory without it is not
complete) and DCP's files, whose index is read without running code it holds (``dcp_index``). ``meta.json`` names
the launch that wrote it (``job_dir``, which restarts, requeues and reruns in that directory share).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from hydraddp.handoff.dcp_index import reader
from hydraddp.models import fit
from hydraddp.tracking import names

STEP_DIR = re.compile(r"^step_(\d{8})$")
META = "meta.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used here: missing, half-written, corrupt, or of another model."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def step_of(path: Path) -> int:
    return int(STEP_DIR.match(Path(path).name)[1])


def complete_checkpoints(root: Path, launch: str | None = None) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (``.tmp`` ones are still being written, or were killed);
    with ``launch``, only those that launch wrote (``written_by``)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / META).exists()]
    if launch is not None:
        found = [p for p in found if written_by(p) == launch]
    return sorted(found, key=step_of)


def written_by(path: Path) -> str | None:
    """The launch that wrote checkpoint ``path``: its job directory, which a restart, a requeue and a rerun in the
    same directory share (None: unreadable, or written without one)."""
    try:
        return read_meta(path).get("job_dir")
    except CheckpointError:
        return None


def others_ahead(root: Path, launch: str, start_step: int) -> list[Path]:
    """Complete checkpoints under ``root`` past ``start_step`` that another launch wrote: a launch starting at
    ``start_step`` would write over them, and ``latest`` would mix the two."""
    return [p for p in complete_checkpoints(root) if step_of(p) > start_step and written_by(p) != launch]


def find(root: Path, resume: str) -> Path:
    """``resume`` (``latest`` or a path) -> the checkpoint directory to load."""
    if resume == "latest":
        found = complete_checkpoints(root)
        if not found:
            raise CheckpointError(f"checkpoint.resume=latest: no complete checkpoint in {root}. "
                                  "Point checkpoint.dir at the run's checkpoints, or give checkpoint.resume=PATH.")
        return found[-1]
    path = Path(resume)
    if not (path / META).exists():
        raise CheckpointError(f"checkpoint.resume={resume}: not a complete hydraddp checkpoint (no {META}).")
    return path


def read_meta(path: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(path) / META).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable {META} ({exc})") from None


PINNED = "pinned.json"  # in a step directory: what outside the checkpoints refers to it (pruning keeps it)


def pin(path: Path, by: str) -> None:
    """Keep checkpoint ``path`` through ``keep_last``'s pruning: ``by`` (a LoggedModel, say) refers to it."""
    (Path(path) / PINNED).write_text(json.dumps({"by": by}))


def check_readable(path: Path) -> dict[str, Any]:
    """The checkpoint's DCP index, or a CheckpointError saying it is corrupt."""
    try:
        return reader(path).read_metadata().state_dict_metadata
    except Exception as exc:
        raise CheckpointError(f"{path}: corrupt or incomplete DCP checkpoint ({type(exc).__name__}: {exc}). "
                              "Resume from another checkpoint (checkpoint.resume=PATH).") from None


def check_matches(path: Path, expected: dict[str, Any], part: bool = False) -> None:
    """Refuse a checkpoint of another model (``expected``: ``{"model": state_dict, ...}``), naming the first keys (or
    shapes) that differ. Every model key must be there; what else both hold (optimizer state) must have its shape.
    ``part``: ``expected`` is part of the model (a pipeline stage), and the checkpoint's other keys are the other
    parts' (the preflight matched the whole model)."""
    saved = {k: tuple(v.size) for k, v in check_readable(path).items() if getattr(v, "size", None) is not None}
    wanted = fit.shapes({k: v for k, v in names.flatten(expected).items() if isinstance(v, torch.Tensor)})

    def of_model(state: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        return {k: v for k, v in state.items() if k.startswith("model.") and (not part or k in wanted)}

    both = {k: v for k, v in saved.items() if k in wanted and not k.startswith("model.")}
    wrong = fit.mismatch(of_model(saved), of_model(wanted)) or fit.mismatch(both, {k: wanted[k] for k in both})
    if wrong:
        raise CheckpointError(f"{path} is not a checkpoint of this model: {wrong}. Use a checkpoint of the same "
                              "model config, or start without checkpoint.resume.")


