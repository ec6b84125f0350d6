"""Preemption: a signal (SIGTERM, SIGUSR2, ...) asks the job to stop; every rank stops at the same step, together.

A handler only records the signal. Every ``check_every`` steps (``checkpoint.preempt_check_every``) the ranks agree on
whether any of them got one, through an all-reduce of a flag in host memory, on a gloo group, started at the end of one
step and read at the end of the next (it overlaps the step, so it costs no wait). Every rank then stops after the same
step, at most ``check_every + 1`` steps after the first signal arrived, writes the checkpoint of that step with the
others and returns. Nothing here touches the device: on a GPU, a flag there would make the host wait for the step's
kernels (``.item()``), and no step that logs nothing may do that. What happens next is the launcher's: exit with
``EXIT_PREEMPTED``, or under submitit, requeue (``hydraddp.clusters.submitit``).

Slurm signals a job before it kills it (submitit asks for USR2: NCCL may use USR1); torch's elastic agent passes
SIGTERM on to its workers and gives them 30 s before it kills them.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import hydraddp.distributed as idist
from hydraddp.handoff.preemption import signal_numbers

log = logging.getLogger("hydraddp.train.loop")


class Preemption:
    """The signals that stop training on this rank, and the ranks' agreement on them. Use as a context manager around
    the loop: the handlers are this rank's while it trains (the main thread only: Python's rule), then restored."""

    def __init__(self, signals: list[str], check_every: int = 1, prunable: bool = False):
        """``prunable``: a search's trial, whose rank 0 may ask every rank to stop (``request_prune``)."""
        self.signals = signal_numbers(signals)
        self.check_every = check_every
        self.received: int | None = None
        self.prunable, self.prune_requested = prunable, False
        self.pruned = False  # the ranks agreed to stop for the search's pruner, not for a signal
        self._previous: dict[int, Any] = {}
        self._pending: tuple[Any, Any] | None = None  # (the all-reduce's handle, its flag tensor)
        self._alone = self._horovod = False
        self._group: Any = None

    def __enter__(self) -> Preemption:
        # Read once, not at every step: agreed() runs in the training loop.
        self._alone, self._horovod = idist.get_world_size() == 1, idist.backend() == "horovod"
        if not (self._alone or self._horovod or not self._agreeing):
            import torch.distributed as dist

            # The flag stays in host memory: the default group if it is gloo's, else a gloo group made now (by every
            # rank: a collective), not the one background checkpoints use from their own thread.
            self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        if threading.current_thread() is threading.main_thread():
            for number in self.signals:
                self._previous[number] = signal.signal(number, self._record)
        return self

    def __exit__(self, *exc: Any) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()
        if self._pending is not None:
            self._pending[0].wait()  # no collective is left half-done

    def _record(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
            log.warning("got %s: stopping after the ranks agree, with a checkpoint", signal.Signals(signum).name)

    @property
    def _agreeing(self) -> bool:
        return bool(self.signals) or self.prunable

    def request_prune(self) -> None:
        """The search's pruner stops this trial (rank 0 asks): every rank stops at the step they agree on."""
        self.prune_requested = True

    def agree_now(self) -> bool:
        """In a search's trial, right after an evaluation (on every rank): the same agreement, at once, so that a
        trial rank 0 was told to prune stops at that step. True as ``agreed``; ``pruned`` says why."""
        if self._alone:
            return self.agreed(0)
        import torch

        if self._pending is not None:  # the one under way carries nothing newer
            self._pending[0].wait()
            self._pending = None
        flags = torch.tensor([0 if self.received is None else 1, int(self.prune_requested)], dtype=torch.int32)
        if self._horovod:
            flags = idist.all_reduce(flags, "MAX")
        else:
            import torch.distributed as dist

            dist.all_reduce(flags, dist.ReduceOp.MAX, group=self._group)
        if not flags.any():
            return False
        self.pruned = not bool(flags[0])
        return True

    def agreed(self, step: int) -> bool:
        """Call at every step's end, on every rank: True once any rank got a signal, or rank 0 asked to prune (the
        same step on every rank; ``pruned`` says which, a signal first). A collective only at a step after a multiple
        of ``check_every`` (its result read) and at the multiple itself (the next one started)."""
        if self._alone:
            self.pruned = self.received is None and self.prune_requested
            return self.received is not None or self.pruned
        if not self._agreeing:
            return False
        import torch
        import torch.distributed as dist

        flags = None
        if self._pending is not None and step % self.check_every == 1 % self.check_every:
            self._pending[0].wait()
            flags, self._pending = self._pending[1], None
        if step % self.check_every == 0 and not (flags is not None and flags.any()):
            flag = torch.tensor([0 if self.received is None else 1, int(self.prune_requested)], dtype=torch.int32)
            if self._horovod:  # no async handle through idist; Horovod's own all-reduce of a host tensor
                flags = idist.all_reduce(flag, "MAX")
            else:
                self._pending = (dist.all_reduce(flag, dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
        if flags is None or not flags.any():
            return False
        self.pruned = not bool(flags[0])
        return True
