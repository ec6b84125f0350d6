"""The plan of a config, made in a process of its own at idle priority: for a launch's MLflow run (``Recording``,
written to ``<job dir>/plan.json``), and for the ``plan`` command and the search's memory budget (``plan_elsewhere``).

A launch whose workers are forked forks its plan the same way, after torch and ``torch._dynamo`` are imported: a
fresh ``python -m hydraddp.plan.record`` spends 2.3 of its 2.6 CPU-seconds importing them (py-spy), and a test suite
or a search pays that at every launch. Anywhere else (spawned workers, under torchrun or srun) it is that command, the
request on stdin: it prints the plan (``Estimate.to_dict``), or ``{"error": ...}`` when the simulated world cannot run
the model; given a path, it writes it there instead.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from hydraddp.forked import ForkedChild, leave_the_launcher

PLANNED_WRAPS = ("none", "ddp", "fsdp", "fsdp2")  # what the simulated world runs (not DataParallel, not Horovod)


def _idle_priority() -> None:
    """``SCHED_IDLE`` (Linux): this process runs only on a core no rank wants, and a rank that wakes from a
    collective takes the core back at once. (What once slowed the ranks by several percent was the tracker's own
    session, which Linux's autogroup weighed against all the ranks together: see ``hydraddp.tracking.process``. Idle
    priority keeps the plan, most of it ``import torch`` where it is not forked, out of the ranks' way wherever it
    runs.) It also dies with the process that started it."""
    if sys.platform != "linux":
        os.nice(19)
        return
    import ctypes

    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def plan_of(request: dict[str, Any]) -> dict[str, Any]:
    """The plan of ``{"config": ..., "world_size": N}`` as a dict, or ``{"error": ...}``."""
    try:
        import torch
        from omegaconf import OmegaConf

        from hydraddp.plan.estimate import estimate

        torch.set_num_threads(1)  # fake tensors compute nothing: more threads would only wake more cores
        return estimate(OmegaConf.create(request["config"]), request["world_size"]).to_dict()
    except Exception as exc:  # a model the simulated world cannot run: the run says so, and trains anyway
        return {"error": f"not planned: {type(exc).__name__}: {exc}"}


def _write(plan: dict[str, Any], path: Path) -> None:
    made = path.with_name(f"{path.name}.{os.getpid()}")
    made.write_text(json.dumps(plan, indent=2))
    os.replace(made, path)  # a reader sees the whole plan or none


def plan_elsewhere(config: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The plan of a resolved config, made by ``python -m hydraddp.plan.record`` (a simulated world of its own: the
    caller's process keeps no fake process group), waited for."""
    request = json.dumps({"config": config, "world_size": world_size})
    done = subprocess.run([sys.executable, "-m", __name__], input=request, capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": f"not planned: the planning process ended with {done.returncode}: {done.stderr[-300:]}"}
    return json.loads(lines[-1])


class Recording:
    """A launch's plan in the making, written to ``path`` (which the tracker logs once it is there): ``wait`` for it
    at a launch's successful end, ``cancel`` it at any other. ``fork`` where the launch forks its workers (this
    process has imported torch and run no tensor op), else a fresh process."""

    def __init__(self, config: dict[str, Any], world_size: int, path: Path, fork: bool):
        import threading

        path.unlink(missing_ok=True)  # an earlier launch's plan in this directory is not this one's
        request = {"config": config, "world_size": world_size}
        self._proc: subprocess.Popen | ForkedChild
        if fork and threading.active_count() == 1:  # a thread's locks would stay held in the child
            # What the fake tensors need (FakeTensorMode imports it), and what the forked workers inherit too.
            import torch._dynamo  # noqa: F401

            pid = os.fork()
            if pid == 0:
                _forked(request, path)
            self._proc = ForkedChild(pid)
        else:
            self._proc = subprocess.Popen([sys.executable, "-m", __name__, str(path)], stdin=subprocess.PIPE,
                                          stdout=subprocess.DEVNULL, text=True)
            self._send(json.dumps(request))

    def _send(self, request: str) -> None:
        assert isinstance(self._proc, subprocess.Popen) and self._proc.stdin is not None
        try:
            self._proc.stdin.write(request)
            self._proc.stdin.close()
        except BrokenPipeError:  # it died at once: there is no plan, and the run says nothing of one
            pass

    def wait(self, timeout_s: float) -> None:
        """Until the plan is written, or ``timeout_s`` passed (the run then has no plan)."""
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass

    def cancel(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def _forked(request: dict[str, Any], path: Path) -> None:
    """The forked plan process: it never returns into the launcher's code."""
    code = 1
    try:
        leave_the_launcher()  # a Ctrl-C or Slurm's signals simply end it
        _idle_priority()
        _write(plan_of(request), path)
        code = 0
    finally:
        os._exit(code)


def main() -> int:
    _idle_priority()  # before torch is imported: its import is most of the work
    plan = plan_of(json.loads(sys.stdin.read()))
    if len(sys.argv) > 1:
        _write(plan, Path(sys.argv[1]))
    else:
        print(json.dumps(plan))
    return 0


if __name__ == "__main__":
    from hydraddp.exit_codes import exit_without_teardown

    exit_without_teardown(main)
