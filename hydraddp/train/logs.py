"""Per-rank logging: console lines prefixed with the rank, and one log file per rank in the job directory."""

from __future__ import annotations

import logging
import sys
from pathlib import Path


FILE_ONLY = "hydraddp_file_only"  # logging's ``extra`` key for records kept out of the console


class ConsoleHandler(logging.StreamHandler):
    """stderr, written around a live progress bar (``tqdm.write``): a log line never lands on the bar's line."""

    bar_active = False  # set while the training loop's bar is on screen (one bar per process)

    def emit(self, record: logging.LogRecord) -> None:
        if not ConsoleHandler.bar_active:
            super().emit(record)
            return
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def setup_rank_logging(rank: int, job_dir: Path | None, level: int = logging.INFO) -> Path | None:
    """Route this process's logging to stderr as ``[rank R] ...`` and to ``<job_dir>/logs/rank{R}.log``."""
    fmt = logging.Formatter(f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    console = ConsoleHandler(sys.stderr)
    console.setFormatter(fmt)
    # A failure's full traceback goes to the rank's file only: the launcher prints one short block for it.
    console.addFilter(lambda record: not getattr(record, FILE_ONLY, False))
    # Every rank logs fully to its file; on the console the others speak only of trouble.
    console.setLevel(level if rank == 0 else logging.WARNING)
    root.addHandler(console)
    path = None
    if job_dir is not None:
        path = Path(job_dir, "logs", f"rank{rank}.log")
        path.parent.mkdir(parents=True, exist_ok=True)
        file = logging.FileHandler(path)
        file.setFormatter(fmt)
        root.addHandler(file)
    root.setLevel(level)
    return path
