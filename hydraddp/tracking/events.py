"""The events file between the training ranks and the tracker: JSON lines, appended by one writer.

It is the durable buffer: whatever the MLflow server does, every point is on disk first, and a point is
sent exactly once because the tracker remembers how far into the file it has read.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

EVENTS_FILE = "events.jsonl"


class EventWriter:
    """Appends metric and tag events; flushed at every call so the tracker sees them promptly."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def metrics(self, values: dict[str, float], step: int, at: float | None = None) -> None:
        """``at``: when the values were measured (``time.time()``), if not now."""
        now = int((time.time() if at is None else at) * 1000)
        for key, value in values.items():
            self._file.write(json.dumps({"metric": key, "value": float(value), "step": step, "ts": now}) + "\n")
        self._file.flush()

    def tag(self, key: str, value: str) -> None:
        self._file.write(json.dumps({"tag": key, "value": str(value)}) + "\n")
        self._file.flush()

    def record(self, kind: str, payload: dict[str, Any]) -> None:
        """Something the tracker logs by a handler of its own (``run.RECORD_HANDLERS``): a dataset input, a model."""
        self._file.write(json.dumps({kind: payload}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_events(path: Path, offset: int = 0, with_ends: bool = False, until: int | None = None):
    """Complete events from byte ``offset`` on (up to byte ``until``), and the offset after the last complete
    line; with ``with_ends``, the offset after each event instead (so progress can be saved event by event)."""
    if not path.exists():
        return [], ([] if with_ends else offset)
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read() if until is None else f.read(max(until - offset, 0))
    events, ends, position = [], [], offset
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break  # a line still being written is left for next time
        position += len(line)
        if line.strip():
            events.append(json.loads(line))
            ends.append(position)
    return events, (ends if with_ends else position)


def write_report(job_dir: str | Path, reports: list[dict[str, Any]]) -> Path:
    """Every rank's WrapReport as ``<job dir>/wrap_report.json`` (uploaded as the run's artifact)."""
    path = Path(job_dir) / "wrap_report.json"
    path.write_text(json.dumps(reports, indent=2))
    return path
