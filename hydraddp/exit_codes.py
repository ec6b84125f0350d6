"""The contract's exit codes, in one place (docs/reference/cli.md): every entry point and the training loop use these."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

EXIT_OK = 0
EXIT_WORKER_FAILED = 1  # a worker failed: the message names the rank and its error
EXIT_INVALID = 2  # invalid configuration, reported before any worker starts, with no traceback
EXIT_PREEMPTED = 3  # stopped by a signal after a complete checkpoint: the same command in the same job dir resumes
EXIT_INTERRUPTED = 130  # Ctrl-C: every worker was stopped


class LaunchEnded(SystemExit):
    """How a launch ended, as its exit code (raised by ``cli``, and by a sweep's job or the search on its behalf).
    Hydra's own exits (a config it cannot compose) are plain SystemExit."""


def exit_without_teardown(main: Callable[[], int | str | None]) -> NoReturn:
    """Run an entry point's ``main`` and end the process as ``sys.exit`` would, less the interpreter's teardown.

    What Python's finalization does first, this does by calling the same functions in the same order:
    ``threading._shutdown`` (the ``threading._register_atexit`` hooks, which stop ``concurrent.futures`` pools such as
    inductor's compile workers, then the join of every non-daemon thread), the ``atexit`` handlers (logging's flush,
    ``weakref.finalize`` clean-ups, multiprocessing's), then the flush of stdout and stderr. What it skips is the
    teardown of every module and object that follows, which with torch loaded costs 0.5-1.5 s of CPU in each process
    (torch, dynamo, mlflow, SQLAlchemy) and holds up the command that waits for it: a launch, its tracker, its plan.
    An exception other than ``SystemExit`` is left to Python, traceback and all.
    """
    try:
        code = main()
    except SystemExit as exc:
        code = exc.code
    if code is not None and not isinstance(code, int):  # sys.exit("message"): printed, status 1
        print(code, file=sys.stderr)
        code = 1
    # Py_FinalizeEx's own first steps (wait_for_thread_shutdown, then the atexit callbacks). Joining the threads
    # without the threading hooks first waits forever on a pool whose workers only its hook tells to stop.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (the reader went away): nothing left to tell it
            pass
    os._exit(code or 0)
