"""``Parallel``: run a function on every rank, spawning workers through torch's elastic agent
(the engine behind torchrun) or attaching to a launcher that already started them."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hydraddp.distributed import api, machine
from hydraddp.distributed.env import detect_launch_env, free_port
from hydraddp.distributed.horovod import HOROVOD

log = logging.getLogger(__name__)


class WorkerFailedError(RuntimeError):
    """A worker raised or died. ``rank`` is the first failing global rank; ``error`` its exception line."""

    def __init__(self, rank: int, error: str, exitcode: int | None = None, traceback: str = ""):
        self.rank, self.error, self.exitcode, self.traceback = rank, error, exitcode, traceback
        super().__init__(f"rank {rank} failed: {error}")


@dataclass
class _Entry:
    """What each spawned worker runs. A dataclass so spawn can pickle it."""

    backend: str
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict[str, Any]
    init_kwargs: dict[str, Any]
    failure_dir: str | None = None
    forked: bool = False

    def __call__(self) -> Any:
        if self.forked:
            # A forked worker inherits the agent's signal handlers; give it a fresh process's instead.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
                signal.signal(sig, signal.SIG_DFL)
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads and threads.isdigit():
            torch.set_num_threads(int(threads))  # the env var alone can arrive after torch set its pool up
        try:
            api.initialize(self.backend, **self.init_kwargs)
            result = self.fn(api.get_local_rank(), *self.args, **self.kwargs)
            api.barrier()  # nobody tears the group down while a peer still talks to it
            return result
        except BaseException as exc:
            self._record_failure(exc)
            raise
        finally:
            api.finalize()

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


def worker_start_method(backend: str | None) -> str:
    """``fork`` where it is safe for a launcher process that has imported torch but run no tensor op, else
    ``spawn``.

    A forked worker starts with torch already imported: about a second sooner than a spawned one, which
    imports it again. Safe for gloo on Linux on a machine without GPUs: a forked child cannot use CUDA once
    its parent initialized it, and a gloo worker may still use a GPU for its tensors, so any visible GPU
    means spawn. A process that ran tensor ops may hold OpenMP threads a child cannot use, so ``Parallel``
    itself defaults to spawn and hydraddp's CLI, whose launching process runs none, asks for this.
    """
    if backend == "gloo" and sys.platform == "linux" and machine.cuda_device_count() == 0 \
            and not torch.cuda.is_initialized():
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


class Parallel:
    """Run ``fn(local_rank, *args)`` on every rank.

    - ``backend=None``: one process, no process group.
    - under torchrun / SLURM / mpirun / horovodrun: attach to this process's rank, call ``fn`` once.
    - ``nproc_per_node=N``: spawn N workers through ``torch.distributed.launcher.api.elastic_launch``
      (c10d rendezvous, so ``nnodes>1`` with ``rdzv_endpoint`` or ``master_addr``/``master_port`` spans nodes;
      ``max_restarts`` restarts the group; ``log_dir`` gets per-rank logs; ``start_method="fork"`` starts
      workers sooner where ``worker_start_method`` says it is safe).

    ``run`` returns ``{global_rank: fn's return value}`` for the ranks of this node.

    >>> def train(local_rank, lr):
    ...     return idist.get_rank()
    >>> idist.Parallel(backend="gloo", nproc_per_node=2).run(train, 0.1)  # doctest: +SKIP
    {0: 0, 1: 1}
    """

    def __init__(
        self,
        backend: str | None = None,
        nproc_per_node: int | None = None,
        nnodes: int | None = None,
        node_rank: int | None = None,
        master_addr: str | None = None,
        master_port: int | None = None,
        *,
        max_restarts: int = 0,
        rdzv_endpoint: str | None = None,
        rdzv_timeout: int = 900,
        run_id: str = "hydraddp",
        log_dir: str | os.PathLike | None = None,
        tee: bool = True,
        monitor_interval: float = 0.1,
        start_method: str = "spawn",
        **init_kwargs: Any,
    ):
        self.backend = None if backend in (None, "none") else backend
        self.nproc_per_node = nproc_per_node
        self.nnodes = nnodes or 1
        self.node_rank = node_rank or 0
        self.master_addr = master_addr
        self.master_port = master_port
        self.max_restarts = max_restarts
        self.rdzv_endpoint = rdzv_endpoint
        self.rdzv_timeout = rdzv_timeout
        self.run_id = run_id
        self.log_dir = log_dir
        self.tee = tee
        self.monitor_interval = monitor_interval
        self.start_method = start_method
        self.init_kwargs = init_kwargs
        if self.backend is not None:
            # Refuse a backend this machine cannot run here, before any worker starts.
            world = (nproc_per_node or 1) * self.nnodes
            machine.raise_for_problems(machine.combination(backend=self.backend, world_size=world), ["backend"])
        if self.nnodes > 1 and not (rdzv_endpoint or (master_addr and master_port)):
            raise ValueError(
                f"nnodes={self.nnodes} needs a rendezvous address every node can reach: "
                "pass rdzv_endpoint='HOST:PORT' (or master_addr and master_port), the same on every node"
            )

    def __enter__(self) -> Parallel:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    @property
    def spawns(self) -> bool:
        """True when ``run`` starts worker processes (rather than running here)."""
        return self.backend is not None and self.nproc_per_node is not None and detect_launch_env() is None

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[int, Any]:
        if self.backend is None:
            return {0: fn(0, *args, **kwargs)}
        if not self.spawns:
            return self._run_attached(fn, args, kwargs)
        if self.backend == HOROVOD:
            return self._run_horovod(fn, args, kwargs)
        return self._run_elastic(fn, args, kwargs)

    def _run_attached(self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> dict[int, Any]:
        launch = detect_launch_env()
        if launch is not None and self.nproc_per_node not in (None, launch.local_world_size):
            log.warning("Started by %s with %d local ranks; nproc_per_node=%s is ignored",
                        launch.source, launch.local_world_size, self.nproc_per_node)
        owns = api.current().backend() is None
        if owns:
            api.initialize(self.backend, **self.init_kwargs)
        try:
            result = {api.get_rank(): fn(api.get_local_rank(), *args, **kwargs)}
            if owns:
                api.barrier()  # as in spawned workers: no teardown while a peer still talks
            return result
        finally:
            if owns:
                api.finalize()

    def _endpoint(self) -> str:
        if self.rdzv_endpoint:
            return self.rdzv_endpoint
        return f"{self.master_addr or '127.0.0.1'}:{self.master_port or free_port()}"

    def _run_elastic(self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> dict[int, Any]:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        rdzv_configs: dict[str, Any] = {"timeout": self.rdzv_timeout}
        if self.nnodes > 1:
            # Say who hosts the store: on loopback every "node" matches the endpoint's address.
            rdzv_configs["is_host"] = self.node_rank == 0
        else:
            # One node: torchrun's default static rendezvous. c10d's dynamic one polls, which left the
            # cores idle for about 0.3 s before the workers were spawned.
            rdzv_configs["rank"] = 0
        logs = DefaultLogsSpecs(
            log_dir=str(self.log_dir) if self.log_dir else None,
            redirects=Std.ALL if self.log_dir else Std.NONE,
            tee=Std.ALL if (self.log_dir and self.tee) else Std.NONE,
        )
        config = LaunchConfig(
            min_nodes=self.nnodes,
            max_nodes=self.nnodes,
            nproc_per_node=self.nproc_per_node,
            run_id=self.run_id,
            rdzv_backend="c10d" if self.nnodes > 1 else "static",
            rdzv_endpoint=self._endpoint(),
            rdzv_configs=rdzv_configs,
            max_restarts=self.max_restarts,
            monitor_interval=self.monitor_interval,
            start_method=self.start_method,
            logs_specs=logs,
        )
        env = {}
        if "OMP_NUM_THREADS" not in os.environ and self.nproc_per_node > 1:
            env["OMP_NUM_THREADS"] = "1"  # torchrun's rule: N ranks must not fight over the same cores
        failure_dir = tempfile.mkdtemp(prefix="hydraddp-failures-")
        entry = _Entry(self.backend, fn, args, kwargs, self.init_kwargs, failure_dir,
                       forked=config.start_method == "fork")
        try:
            with _worker_env(env), _quiet_elastic_errors():
                return elastic_launch(config, _run_entry)(entry)
        except ChildFailedError as exc:
            raise (_first_recorded_failure(failure_dir) or _failure_from(exc)) from None
        except SignalException as exc:
            # The agent already stopped every worker; report it as the interrupt it was.
            raise KeyboardInterrupt(f"stopped by {exc.sigval.name}") from None
        finally:
            shutil.rmtree(failure_dir, ignore_errors=True)

    def _run_horovod(self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> dict[int, Any]:
        """Spawn through Horovod's own runner (gloo controller), as horovodrun would."""
        import horovod

        env = {"OMP_NUM_THREADS": "1"} if "OMP_NUM_THREADS" not in os.environ and self.nproc_per_node > 1 else {}
        failure_dir = tempfile.mkdtemp(prefix="hydraddp-failures-")
        entry = _Entry(HOROVOD, fn, args, kwargs, self.init_kwargs, failure_dir)
        try:
            with _worker_env(env):
                results = horovod.run(entry, np=self.nproc_per_node, use_gloo=True)
        except RuntimeError as exc:
            raise (_first_recorded_failure(failure_dir) or WorkerFailedError(-1, str(exc))) from None
        finally:
            shutil.rmtree(failure_dir, ignore_errors=True)
        return dict(enumerate(results))
