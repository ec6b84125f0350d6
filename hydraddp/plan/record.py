"""``python -m hydraddp.plan.record``: the plan of one launch, for its MLflow run. The tracker starts it at idle
priority beside the workers and sends ``{"config": ..., "world_size": N}`` (the launch's resolved config) on stdin;
it prints the plan (``Estimate.to_dict``), or ``{"error": ...}`` when the simulated world cannot run the model."""

from __future__ import annotations

import json
import os
import signal
import sys


def _idle_priority() -> None:
    """``SCHED_IDLE`` (Linux): this process runs only on a core no rank wants, and a rank that wakes from a
    collective takes the core back at once. (What once slowed the ranks by several percent was the tracker's own
    session, which Linux's autogroup weighed against all the ranks together: see ``hydraddp.tracking.process``. Idle
    priority keeps the plan, most of it ``import torch``, out of the ranks' way wherever it runs.) It also dies with
    the tracker that started it."""
    if sys.platform != "linux":
        os.nice(19)
        return
    import ctypes

    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main() -> int:
    _idle_priority()  # before torch is imported: its import is most of the work
    request = json.loads(sys.stdin.read())
    try:
        import torch
        from omegaconf import OmegaConf

        from hydraddp.plan.estimate import estimate

        torch.set_num_threads(1)  # fake tensors compute nothing: more threads would only wake more cores
        plan = estimate(OmegaConf.create(request["config"]), request["world_size"]).to_dict()
    except Exception as exc:  # a model the simulated world cannot run: the run says so, and trains anyway
        plan = {"error": f"not planned: {type(exc).__name__}: {exc}"}
    print(json.dumps(plan))
    return 0


if __name__ == "__main__":
    from hydraddp.exit_codes import exit_without_teardown

    exit_without_teardown(main)
