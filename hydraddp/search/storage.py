"""Where a study lives, and how a trial whose sweeper or launch died is found and failed (so the study tries it
again), on any host.

- A database (``sqlite:///``, ``postgresql://``, ``mysql://``): optuna's ``RDBStorage`` with its heartbeat. The
  sweeper records one for each of its running trials every ``heartbeat_interval`` seconds; a RUNNING trial without
  one for ``grace_period`` seconds is failed by whichever sweeper looks next (``optuna.storages.fail_stale_trials``).
- A file on a shared file system (``journal:///shared/study.journal``): optuna's ``JournalStorage`` with its
  ``JournalFileOpenLock``, an ``O_EXCL`` lock file that holds on NFS and Lustre, where ``flock`` locks on each node
  alone. Journals have no heartbeat in optuna: the sweeper writes the same beat as a trial attribute instead.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Callable, Iterator

from hydraddp import lease
from hydraddp.handoff.trial import JOURNAL

BEAT = "hydraddp_heartbeat"  # a journal trial's system attribute: when its sweeper last said it runs (time.time())
ERROR = "hydraddp_error"  # a failed trial's user attribute: why (its launch's output, or the missed heartbeat)
REMOTE_REACHABLE = ("postgresql", "mysql", JOURNAL)  # what trials on other machines can report to
OWNER = "hydraddp_owner"  # a trial's system attribute: {"host", "pid"} of the sweeper that runs it


@contextlib.contextmanager
def creating(storage: str) -> Iterator[None]:
    """Two sweepers starting at once on a fresh SQLite file both create optuna's tables, and one fails ("table
    studies already exists"): they take turns under a lease beside the file (``hydraddp.lease``: not ``flock``, which
    on cluster mounts locks on each node alone; a holder that dies frees it). A database server creates its tables in
    transactions of its own."""
    from hydraddp.tracking.client import creating_sqlite

    with creating_sqlite(storage):
        yield


def fail_orphans(study: Any) -> list[int]:
    """Mark FAIL at once the RUNNING trials of a sweeper on this host that is gone (a killed sweeper); a live
    sweeper's trials are left as they are, and other hosts' to the heartbeat (``fail_stale``)."""
    from optuna.trial import TrialState

    host, failed = socket.gethostname(), []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = trial.system_attrs.get(OWNER)
        if owner and owner.get("host") == host and not lease.alive(int(owner["pid"])):
            study._storage.set_trial_user_attr(trial._trial_id, ERROR, "its sweeper died while it ran")
            study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
            failed.append(trial.number)
    return failed


# The sweeper's own hydra overrides, which no trial gets: the search's settings, and where its output goes.


def beat(study: Any, trial_id: int) -> None:
    """Say that the trial still runs."""
    storage = study._storage
    if hasattr(storage, "record_heartbeat"):
        storage.record_heartbeat(trial_id)
    else:
        storage.set_trial_system_attr(trial_id, BEAT, time.time())


def fail_stale(study: Any, grace_period: int, on_stale: Callable[[Any, Any], None]) -> None:
    """Fail the RUNNING trials no sweeper has beaten for for ``grace_period`` seconds, and tell ``on_stale``."""
    import optuna
    from optuna.trial import TrialState

    storage = study._storage
    if hasattr(storage, "record_heartbeat"):
        optuna.storages.fail_stale_trials(study)  # calls on_stale, given to the storage
        return
    now = time.time()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        last = trial.system_attrs.get(BEAT) or trial.datetime_start.timestamp()
        if now - last <= grace_period:
            continue
        try:
            storage.set_trial_user_attr(trial._trial_id, ERROR, f"no heartbeat for {grace_period} s")
            if storage.set_trial_state_values(trial._trial_id, TrialState.FAIL):
                on_stale(study, storage.get_trial(trial._trial_id))
        except optuna.exceptions.UpdateFinishedTrialError:  # another sweeper failed it first
            pass


class Heartbeat:
    """A sweeper's beat for each of its running trials every ``interval`` seconds, in a thread of its own, which
    also fails the trials of any sweeper gone quiet for ``grace_period`` (``fail_stale``): at the start, and while
    this one runs."""

    def __init__(self, study: Any, interval: int, grace_period: int, on_stale: Callable[[Any, Any], None]):
        self.study, self.interval, self.grace_period, self.on_stale = study, interval, grace_period, on_stale
        self._running: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="hydraddp-search-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        fail_stale(self.study, self.grace_period, self.on_stale)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def add(self, trial_id: int) -> None:
        beat(self.study, trial_id)
        with self._lock:
            self._running.add(trial_id)

    def remove(self, trial_id: int) -> None:
        with self._lock:
            self._running.discard(trial_id)

    def _beat(self) -> None:
        import optuna

        while not self._stop.wait(self.interval):
            with self._lock:
                running = sorted(self._running)
            try:
                for trial_id in running:
                    with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                        beat(self.study, trial_id)
                fail_stale(self.study, self.grace_period, self.on_stale)
            except Exception as exc:  # a storage that did not answer this time: the next beat tries again
                print(f"hydraddp search: heartbeat not recorded: {exc!r}", flush=True)
