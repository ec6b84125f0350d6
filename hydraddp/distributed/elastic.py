"""Start workers on this node: torch's elastic agent (the engine behind torchrun) for the native backends, Horovod's
own runner for Horovod. Each worker starts the computation model that spawned it, runs
``fn(local_rank, *args, **kwargs)`` and tears the model down; a failure comes back as one ``WorkerFailedError``
naming the first failing rank."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch

from hydraddp.distributed import context, fork_gate

from hydraddp.parallel import machine
from hydraddp.distributed.comp_models.base import ComputationModel
from hydraddp.distributed.env import free_port


class WorkerFailedError(RuntimeError):
    """A worker raised or died. ``rank`` is the first failing global rank; ``error`` its exception line."""

    def __init__(self, rank: int, error: str, exitcode: int | None = None, traceback: str = ""):
        self.rank, self.error, self.exitcode, self.traceback = rank, error, exitcode, traceback
        super().__init__(f"rank {rank} failed: {error}")


@dataclass
class _Entry:
    """What each spawned worker runs. A dataclass so spawn can pickle it."""

    model_cls: type[ComputationModel]  # the model that spawned the workers, started in each of them
    backend: str
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict[str, Any]
    init_kwargs: dict[str, Any]
    failure_dir: str | None = None
    forked: bool = False
    env: dict[str, str | None] = field(default_factory=dict)  # set (None: unset) in the worker before it starts

    def __call__(self) -> Any:
        if self.forked:
            # A forked worker inherits the agent's signal handlers; give it a fresh process's instead.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
                signal.signal(sig, signal.SIG_DFL)
            fork_gate.wait()  # no store connection while the launcher still forks (fork_gate)
        if self.failure_dir is not None:  # where the launcher finds its workers (_forwarding)
            Path(self.failure_dir, f"{os.getpid()}{WORKER_PID_SUFFIX}").touch()
        for key, value in self.env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads and threads.isdigit():
            torch.set_num_threads(int(threads))  # the env var alone can arrive after torch set its pool up
        try:
            context.raise_if_active()
            context.start(self.model_cls, self.backend, **self.init_kwargs)
            result = self.fn(context.model().get_local_rank(), *self.args, **self.kwargs)
            context.model().barrier()  # nobody tears the group down while a peer still talks to it
            self._record_done()
            return result
        except BaseException as exc:
            self._record_failure(exc)
            if isinstance(exc, KeyboardInterrupt):
                _stop_without_unwinding()
            raise
        finally:
            _exit_or_be_ended()
            context.finalize()

    def _record_done(self) -> None:
        # A worker ended at exit (``_exit_or_be_ended``) after its work was done: the parent says so, not "failed".
        if self.failure_dir is not None:
            Path(self.failure_dir, f"rank{os.environ.get('RANK', os.environ.get('HOROVOD_RANK', '-1'))}"
                                   f"{DONE_SUFFIX}").write_text(f"{EXIT_GRACE_S:g}")

    def _record_failure(self, exc: BaseException) -> None:
        # torch reports only the rank whose exit it noticed first, often a peer that failed *because* the
        # real culprit died. Each rank notes when it failed, so the parent can name the first one.
        if self.failure_dir is None:
            return
        record = {
            "rank": int(os.environ.get("RANK", os.environ.get("HOROVOD_RANK", "-1"))),
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            "time": time.time(),
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }
        Path(self.failure_dir, f"rank{record['rank']}.json").write_text(json.dumps(record))


EXIT_GRACE_S = 120.0  # from the end of a worker's work to its exit; ample for the teardown on a loaded machine


def _exit_or_be_ended() -> None:
    """A worker whose work is done (returned, or raised) has ``EXIT_GRACE_S`` to leave: what remains is the group's
    teardown, the hand-over of its result to the agent and the process's own exit. Past that, faulthandler's watchdog
    thread (C, without the GIL, so a stuck native call cannot hold it off) writes every thread's stack to the rank's
    stderr under "Timeout (0:02:00)!", and ends the process with exit code 1. torch's agent waits for every worker to
    exit with no limit (``MultiprocessContext._poll``: "pc.join() blocks [forever]"): one worker that hung at exit,
    its training done and its checkpoint written, held a 2-rank launch past its test's 180 s."""
    faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True)


def _stop_without_unwinding() -> NoReturn:
    """A worker told to stop (the agent passes Ctrl-C on as SIGINT) leaves at once, its logs flushed.

    Unwinding a step that SIGINT cut short frees DDP's reducer, whose process group joins gloo's thread; that thread
    is finishing the interrupted all-reduce and needs the GIL to drop its tensors, which the freeing thread holds.
    torch then deadlocks until the agent's 30-second grace ends in SIGKILL (py-spy: ``~Reducer`` ->
    ``~ProcessGroupGloo`` -> ``std::thread::join``, and gloo's ``~AsyncWork`` waiting in ``gil_scoped_acquire``):
    one Ctrl-C in four took 30 s to return. Nothing is left to tear down that the exit itself does not."""
    logging.getLogger(__name__).warning("rank %s stopped: interrupted", os.environ.get("RANK", "?"))
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(128 + signal.SIGINT)


def worker_start_method(backend: str | None, nnodes: int = 1, node_rank: int = 0) -> str:
    """``fork`` where it is safe for a launcher process that has imported torch but run no tensor op, else
    ``spawn``.

    A forked worker starts with torch already imported: about a second sooner than a spawned one, which
    imports it again. Safe for gloo on Linux on a machine without GPUs: a forked child cannot use CUDA once
    its parent initialized it, and a gloo worker may still use a GPU for its tensors, so any visible GPU
    means spawn. A process that ran tensor ops may hold OpenMP threads a child cannot use, so ``Parallel``
    itself defaults to spawn and hydraddp's CLI, whose launching process runs none, asks for this. Not on the node
    that hosts the agents' store (node 0) of several: its store thread must not be naming a connection while the
    agent forks (``fork_gate``), and the other nodes' workers connect to it whenever they start. (On one node, only
    its own workers do, and they wait for their round's forks.)
    """
    if backend == "gloo" and (nnodes == 1 or node_rank != 0) and sys.platform == "linux" \
            and machine.cuda_device_count() == 0 and not torch.cuda.is_initialized():
        return "fork"
    return "spawn"


def _run_entry(entry: _Entry) -> Any:
    """The spawned process's entrypoint (elastic_launch wants a named function)."""
    return entry()


def _first_recorded_failure(failure_dir: str) -> WorkerFailedError | None:
    records = [json.loads(p.read_text()) for p in Path(failure_dir).glob("rank*.json")]
    if not records:
        return None
    first = min(records, key=lambda r: (-r["attempt"], r["time"]))
    return WorkerFailedError(first["rank"], first["error"], 1, first["traceback"])


def _stuck_at_exit(failure_dir: str, exc: Exception) -> WorkerFailedError | None:
    """The failed rank had done its work and was ended by ``_exit_or_be_ended``: say that, with where its stacks are."""
    rank, failure = exc.get_first_failure()
    done = Path(failure_dir, f"rank{rank}{DONE_SUFFIX}")
    if failure.exitcode != 1 or not done.exists():
        return None
    return WorkerFailedError(rank, f"its work was done, but it did not exit within {done.read_text()} s; the stacks of "
                                   "its threads follow \"Timeout\" in its stderr (its log)", failure.exitcode)


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text


def _failure_from(exc: Exception) -> WorkerFailedError:
    """torch's ChildFailedError -> one error naming the first failing rank and its exception."""
    rank, failure = exc.get_first_failure()
    message = failure.message if isinstance(failure.message, str) else str(failure.message)
    details = failure.error_file_data.get("message", {}) if isinstance(failure.error_file_data, dict) else {}
    traceback = details.get("extraInfo", {}).get("py_callstack", "") if isinstance(details, dict) else ""
    if failure.exitcode < 0 and not traceback:
        message = f"killed by signal {signal.Signals(-failure.exitcode).name}"
    return WorkerFailedError(rank, _first_line(traceback) if traceback else message, failure.exitcode, traceback)


@contextlib.contextmanager
def _worker_env(updates: dict[str, str]) -> Iterator[None]:
    """Spawned workers copy this process's environment when they start; set ours for that moment only."""
    saved = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _quiet_elastic_errors() -> Iterator[None]:
    """torch's agent logs every failed worker's traceback at ERROR; ``WorkerFailedError`` carries it already,
    so a failure is reported once, by whoever catches that error."""
    logger = logging.getLogger("torch.distributed.elastic")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)




WORKER_PID_SUFFIX = ".worker"  # a worker's file in its launch's scratch directory, named by its pid
DONE_SUFFIX = ".done"  # rank{R}.done: that rank's work is done, only its exit is left
FORWARDED_SIGNALS = ("SIGUSR1", "SIGUSR2")


@contextlib.contextmanager
def _forwarding(workers_dir: str) -> Iterator[None]:
    """torch's agent stops the workers on SIGTERM, SIGINT, SIGHUP and SIGQUIT; any other stop signal a job is sent
    (Slurm's SIGUSR1 or SIGUSR2 before a time limit, to every process of the job; ``kill -USR2`` to the launcher)
    would end the agent itself and orphan its workers. The launcher passes it on to its workers instead (each
    registered its pid in ``workers_dir``), which stop together at a step they agree on; a worker that had it
    already takes the second as the same request."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: Any) -> None:
        for registered in Path(workers_dir).glob(f"*{WORKER_PID_SUFFIX}"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(registered.name.removesuffix(WORKER_PID_SUFFIX)), signum)

    numbers = [getattr(signal, name) for name in FORWARDED_SIGNALS if hasattr(signal, name)]
    previous = {number: signal.signal(number, forward) for number in numbers}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _one_thread_per_rank(nproc_per_node: int) -> dict[str, str]:
    # torchrun's rule: N ranks must not fight over the same cores, unless the user chose.
    return {"OMP_NUM_THREADS": "1"} if "OMP_NUM_THREADS" not in os.environ and nproc_per_node > 1 else {}


def launch(
    model_cls: type[ComputationModel],
    backend: str,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict[str, Any],
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | str | None = None,
    max_restarts: int = 0,
    rdzv_endpoint: str | None = None,
    rdzv_timeout: int = 900,
    run_id: str = "hydraddp",
    log_dir: str | os.PathLike | None = None,
    tee: bool = True,
    monitor_interval: float = 0.1,
    start_method: str = "spawn",
    **init_kwargs: Any,
) -> dict[int, Any]:
    """Spawn ``nproc_per_node`` workers through ``torch.distributed.launcher.api.elastic_launch``, each starting
    ``model_cls`` on ``backend``.

    One node uses torchrun's static rendezvous; ``nnodes>1`` uses c10d at ``rdzv_endpoint`` (or
    ``master_addr:master_port``), hosted by node 0. ``max_restarts`` restarts the group, ``log_dir`` gets per-rank
    logs, ``init_kwargs`` go to each worker's ``create_from_backend``.
    Returns ``{global_rank: fn's return value}`` for this node's ranks.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    config = _launch_config(
        nproc_per_node=nproc_per_node, nnodes=nnodes, node_rank=node_rank, master_addr=master_addr,
        master_port=master_port, max_restarts=max_restarts, rdzv_endpoint=rdzv_endpoint, rdzv_timeout=rdzv_timeout,
        run_id=run_id, log_dir=log_dir, tee=tee, monitor_interval=monitor_interval, start_method=start_method,
    )
    if config.start_method == "fork":
        # DDP's and FSDP's constructors import torch._dynamo (about 2 CPU-seconds here): imported once in this
        # process, each forked worker inherits it instead of importing it again. (py-spy: it was 85% of a DDP
        # worker's time before its first step.) It starts no thread, so forking after it stays safe.
        import torch._dynamo  # noqa: F401
    failure_dir = tempfile.mkdtemp(prefix="hydraddp-failures-")
    entry = _Entry(model_cls, backend, fn, args, kwargs, init_kwargs, failure_dir,
                   forked=config.start_method == "fork")
    try:
        with _worker_env(_one_thread_per_rank(nproc_per_node)), _quiet_elastic_errors(), _forwarding(failure_dir), \
                (fork_gate.forking(nproc_per_node) if entry.forked else contextlib.nullcontext()):
            return elastic_launch(config, _run_entry)(entry)
    except ChildFailedError as exc:
        raise (_first_recorded_failure(failure_dir) or _stuck_at_exit(failure_dir, exc) or _failure_from(exc)) \
            from None
    except SignalException as exc:
        # The agent already stopped every worker; report it as the interrupt it was.
        raise KeyboardInterrupt(f"stopped by {exc.sigval.name}") from None
    finally:
        shutil.rmtree(failure_dir, ignore_errors=True)


def _launch_config(*, nproc_per_node: int, nnodes: int, node_rank: int, master_addr: str | None,
                   master_port: int | str | None, max_restarts: int, rdzv_endpoint: str | None, rdzv_timeout: int,
                   run_id: str, log_dir: str | os.PathLike | None, tee: bool, monitor_interval: float,
                   start_method: str) -> Any:
    """torch's ``LaunchConfig`` for ``launch``: the rendezvous, the restarts and where the ranks' logs go."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    if nnodes > 1 and not (rdzv_endpoint or (master_addr and master_port)):
        raise ValueError(
            f"nnodes={nnodes} needs a rendezvous address every node can reach: "
            "pass rdzv_endpoint='HOST:PORT' (or master_addr and master_port), the same on every node"
        )
    endpoint = rdzv_endpoint or f"{master_addr or '127.0.0.1'}:{master_port or free_port()}"
    rdzv_configs: dict[str, Any] = {"timeout": rdzv_timeout}
    if nnodes > 1:
        # Say who hosts the store: on loopback every "node" matches the endpoint's address.
        rdzv_configs["is_host"] = node_rank == 0
    else:
        # One node: torchrun's default static rendezvous. c10d's dynamic one polls, which left the
        # cores idle for about 0.3 s before the workers were spawned.
        rdzv_configs["rank"] = 0
    logs = DefaultLogsSpecs(
        log_dir=str(log_dir) if log_dir else None,
        redirects=Std.ALL if log_dir else Std.NONE,
        tee=Std.ALL if (log_dir and tee) else Std.NONE,
    )
    return LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc_per_node,
        run_id=run_id,
        rdzv_backend="c10d" if nnodes > 1 else "static",
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        start_method=start_method,
        logs_specs=logs,
    )


# horovod.run (0.28.1) sets these to "(None,)" in every worker, from a stray comma in its _HorovodArgs, over any value
# the user gave. Horovod then reads a cycle time of 0 ms and a response cache of 0 entries: its background loop spins,
# about half a core per rank while the rank waits (strace: ~3,700 gloo messages a second between two idle ranks).
HOROVOD_RUN_MISSETS = ("HOROVOD_CYCLE_TIME", "HOROVOD_CACHE_CAPACITY")


def launch_horovod(model_cls: type[ComputationModel], backend: str, fn: Callable[..., Any], args: tuple,
                   kwargs: dict[str, Any], nproc_per_node: int, hosts: str | None = None,
                   **init_kwargs: Any) -> dict[int, Any]:
    """Spawn through Horovod's own runner (gloo controller), as horovodrun would; each worker starts ``model_cls``
    on ``backend``."""
    import horovod

    failure_dir = tempfile.mkdtemp(prefix="hydraddp-failures-")
    # The launcher's own values (or none: Horovod's defaults) replace what horovod.run sets there.
    entry = _Entry(model_cls, backend, fn, args, kwargs, init_kwargs, failure_dir,
                   env={key: os.environ.get(key) for key in HOROVOD_RUN_MISSETS})
    try:
        with _worker_env(_one_thread_per_rank(nproc_per_node)):
            results = horovod.run(entry, np=nproc_per_node, hosts=hosts, use_gloo=True)
    except RuntimeError as exc:
        raise (_first_recorded_failure(failure_dir) or WorkerFailedError(-1, str(exc))) from None
    finally:
        shutil.rmtree(failure_dir, ignore_errors=True)
    return dict(enumerate(results))
