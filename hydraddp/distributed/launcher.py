"""``Parallel``: ignite's launcher. Run a function on every rank, spawning workers through torch's elastic agent (the
engine behind torchrun) or attaching to a launcher that already started them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from hydraddp.distributed import utils

from hydraddp.parallel import machine
from hydraddp.distributed.comp_models.horovod import HOROVOD
from hydraddp.distributed.comp_models.native import NATIVE_BACKENDS, refuse_tcp_init_method
from hydraddp.distributed.comp_models.xla import NOT_SUPPORTED as XLA_NOT_SUPPORTED
from hydraddp.distributed.comp_models.xla import XLA_TPU
from hydraddp.distributed.elastic import WorkerFailedError, worker_start_method  # noqa: F401 (re-exported)
from hydraddp.distributed.env import detect_launch_env

log = logging.getLogger(__name__)

# Options of the workers' launch (``elastic.launch``, ``horovod.run``); every other keyword goes to ``initialize``.
SPAWN_OPTIONS = frozenset({"max_restarts", "rdzv_endpoint", "rdzv_timeout", "run_id", "log_dir", "tee",
                           "monitor_interval", "start_method", "join", "daemon", "hosts"})


class Parallel:
    """Run ``fn(local_rank, *args, **kwargs)`` on every rank (ignite's ``idist.Parallel``).

    - ``backend=None``: one process, no process group.
    - under torchrun / SLURM / mpirun / horovodrun: attach to this process's rank, call ``fn`` once.
    - ``nproc_per_node=N``: spawn N workers through ``torch.distributed.launcher.api.elastic_launch``
      (or ``horovod.run``). ``nnodes>1`` needs ``node_rank`` and ``master_addr``/``master_port`` (or
      ``rdzv_endpoint='HOST:PORT'``), the same on every node.

    Keywords beyond ignite's: ``max_restarts`` (restart the group), ``rdzv_endpoint``, ``rdzv_timeout``,
    ``run_id``, ``log_dir`` (per-rank logs), ``tee``, ``monitor_interval`` and ``start_method="fork"`` (starts
    workers sooner where ``worker_start_method`` says it is safe). Any other keyword goes to each rank's
    ``initialize`` (``timeout``, ...).

    ``run`` returns ``{global_rank: fn's return value}`` for the ranks of this process's node (ignite: None).
    Use it as a context manager (ignite's way: the group lives for the ``with`` block) or call ``run`` alone.

    >>> def train(local_rank, lr):
    ...     return idist.get_rank()
    >>> with idist.Parallel(backend="gloo", nproc_per_node=2) as parallel:  # doctest: +SKIP
    ...     parallel.run(train, 0.1)
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
        init_method: str | None = None,
        **spawn_kwargs: Any,
    ):
        backend = None if backend == "none" else backend
        if backend is None:
            given = {"nproc_per_node": nproc_per_node, "nnodes": nnodes, "node_rank": node_rank,
                     "master_addr": master_addr, "master_port": master_port}
            for name, value in given.items():
                if value is not None:
                    raise ValueError(f"If backend is None, argument '{name}' should be also None, but given {value}")
        elif backend == XLA_TPU:
            raise ValueError(XLA_NOT_SUPPORTED)
        else:
            if backend in (*NATIVE_BACKENDS, HOROVOD):
                # Refuse a backend this machine cannot run, with the fix, before any worker starts.
                world = (nproc_per_node or 1) * (nnodes or 1)
                machine.raise_for_problems(machine.combination(backend=backend, world_size=world), ["backend"])
            if not utils.is_available(backend):
                raise ValueError(f"Unknown backend '{backend}'. Available backends: {utils.available_backends()}")
        refuse_tcp_init_method(init_method)
        self.backend = backend
        self.init_method = init_method
        self.init_kwargs = {k: v for k, v in spawn_kwargs.items() if k not in SPAWN_OPTIONS}
        self._spawn_params: dict[str, Any] | None = None
        if backend is not None and nproc_per_node is not None:
            self._spawn_params = self._setup_spawn_params(nproc_per_node, nnodes, node_rank, master_addr, master_port,
                                                          init_method, **spawn_kwargs)
        self._logger: logging.Logger | None = None
        self._owns_context = False

    @staticmethod
    def _setup_spawn_params(nproc_per_node: int, nnodes: int | None = None, node_rank: int | None = None,
                            master_addr: str | None = None, master_port: int | None = None,
                            init_method: str | None = None, **spawn_kwargs: Any) -> dict[str, Any]:
        if nproc_per_node < 1:
            raise ValueError(f"Argument nproc_per_node should positive, but given {nproc_per_node}")
        nnodes = 1 if nnodes is None else nnodes
        if nnodes < 1:
            raise ValueError(f"Argument nnodes should positive, but given {nnodes}")
        if node_rank is None:
            if nnodes > 1:
                raise ValueError("If number of nodes larger than one, arguments node_rank should be given")
            node_rank = 0
        if node_rank >= nnodes or node_rank < 0:
            raise ValueError(f"Argument node_rank should be between 0 and {nnodes - 1}, but given {node_rank}")
        if nnodes > 1 and (master_addr is None or master_port is None) and init_method is None \
                and not spawn_kwargs.get("rdzv_endpoint"):
            raise ValueError(
                "If number of nodes larger than one, arguments master_addr and master_port or init_method "
                f"should be specified, but given master_addr={master_addr}, master_port={master_port} and "
                f"init_method={init_method}."
            )
        params = {"nproc_per_node": nproc_per_node, "nnodes": nnodes, "node_rank": node_rank,
                  "master_addr": master_addr, "master_port": master_port, "init_method": init_method,
                  **spawn_kwargs}
        return {k: v for k, v in params.items() if v is not None}

    @property
    def spawns(self) -> bool:
        """True when ``run`` starts worker processes; under an outside launcher it attaches instead."""
        return self._spawn_params is not None and detect_launch_env() is None

    def _initialize(self) -> None:
        # Attach to a group that exists already (a user's, torchrun's script); else start one.
        if utils.backend() is None:
            utils.initialize(self.backend, init_method=self.init_method, **self.init_kwargs)
            self._owns_context = True

    def __enter__(self) -> Parallel:
        if self.backend is not None and not self.spawns:
            self._initialize()
        self._logger = utils._setup_logger(f"{__name__}.{type(self).__name__}")
        if self.backend is not None:
            if not self.spawns:
                self._logger.info(f"Initialized processing group with backend: '{self.backend}'")
            else:
                self._logger.info(f"Initialized distributed launcher with backend: '{self.backend}'")
                params = "\n\t".join(f"{k}: {v}" for k, v in self._spawn_params.items())
                self._logger.info(f"- Parameters to spawn processes: \n\t{params}")
        return self

    def __exit__(self, *args: Any, **kwargs: Any) -> None:
        if self._owns_context:
            if self._logger is not None:
                self._logger.info(f"Finalized processing group with backend: '{self.backend}'")
            self._finalize()

    def _finalize(self) -> None:
        self._owns_context = False
        utils.finalize()

    def _info(self, message: str) -> None:
        if self._logger is not None:  # only inside ``with``, as ignite logs
            self._logger.info(message)

    def run(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[int, Any]:
        if self.spawns:
            self._info(f"Spawn function '{func}' in {self._spawn_params['nproc_per_node']} processes")
            results = utils.spawn(self.backend, func, args=args, kwargs_dict=kwargs, **self._spawn_params)
        else:
            results = self._run_here(func, args, kwargs)
        self._info("End of run")
        return results

    def _run_here(self, func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> dict[int, Any]:
        launch = detect_launch_env()
        if launch is not None and self._spawn_params is not None \
                and self._spawn_params["nproc_per_node"] != launch.local_world_size:
            log.warning("Started by %s with %d local ranks; nproc_per_node=%s is ignored",
                        launch.source, launch.local_world_size, self._spawn_params["nproc_per_node"])
        started_here = self.backend is not None and not self._owns_context
        if started_here:
            self._initialize()
            started_here = self._owns_context
        try:
            self._info(f"- Run '{func}' in {utils.get_world_size()} processes")
            result = {utils.get_rank(): func(utils.get_local_rank(), *args, **kwargs)}
            if started_here:
                utils.barrier()  # as in spawned workers: no teardown while a peer still talks
            return result
        finally:
            if started_here:
                self._finalize()
