"""One launch: the resolved config goes to every rank through ``hydraddp.distributed.Parallel``."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

import hydraddp.distributed as idist
from hydraddp.config.validate import resolve_backend

log = logging.getLogger(__name__)


def worker(local_rank: int, plain_cfg: dict[str, Any], job_dir: str, events_path: str | None,
           attached: bool, saved_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """What every rank runs: the config arrives resolved; it is never composed again here.

    ``events_path`` is where the tracker reads MLflow events; local rank 0 of the node that tracks writes them.
    """
    from hydraddp.tracking.events import EventWriter
    from hydraddp.train import train
    from hydraddp.train.logs import setup_rank_logging

    if attached and idist.get_world_size() > 1:
        # Under torchrun every process made its own choice of directory; all of them take rank 0's.
        job_dir = idist.broadcast(job_dir, src=0)
    setup_rank_logging(idist.get_rank(), Path(job_dir))
    log.info("rank %d pid %d", idist.get_rank(), os.getpid())
    events = EventWriter(events_path) if events_path and idist.get_local_rank() == 0 else None
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if events is not None and restarts:
        events.tag("hydraddp.restarts", str(restarts))  # the run shows that torch's agent restarted the group
    try:
        result = train(OmegaConf.create(plain_cfg), Path(job_dir), events, saved_config)
        return {**result.to_dict(), "job_dir": job_dir}
    except Exception:
        logging.getLogger(__name__).exception("training failed")
        raise
    finally:
        if events is not None:
            events.close()


def resolved(cfg: DictConfig) -> dict[str, Any]:
    """The config as plain data with every interpolation resolved once, here, and ``backend=auto`` decided."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain["backend"]["name"] = resolve_backend(cfg.backend.name)
    return plain


def parallel_for(plain: dict[str, Any]) -> idist.Parallel:
    backend, launcher = plain["backend"]["name"], plain["launcher"]
    return idist.Parallel(
        backend=None if backend == "none" else backend,
        nproc_per_node=launcher["nproc_per_node"],
        nnodes=launcher["nnodes"],
        node_rank=launcher["node_rank"],
        rdzv_endpoint=launcher["rdzv_endpoint"],
        max_restarts=launcher["max_restarts"],
        start_method=idist.worker_start_method(backend),
    )


def redacted(cfg: DictConfig, plain: dict[str, Any]) -> dict[str, Any]:
    """``plain`` with every secret masked: values from ``${oc.env:...}`` (known only before resolving) and
    everything under a secret-looking key. What leaves the job's memory (MLflow, checkpoints) is this."""
    from hydraddp.tracking import names

    return names.redact(plain, names.secret_paths(OmegaConf.to_container(cfg, resolve=False)))


def launch(plain: dict[str, Any], job_dir: Path, events_path: Path | None = None,
           saved_config: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    """Run the resolved config ``plain`` (see ``resolved``) on all ranks; checkpoints keep ``saved_config``
    (see ``redacted``). Returns the lowest global rank this process saw (0 when it spawned the workers or is
    rank 0 under torchrun) and that rank's ``TrainResult``."""
    parallel = parallel_for(plain)
    results = parallel.run(worker, plain, str(job_dir), str(events_path) if events_path else None, not parallel.spawns,
                           saved_config)
    rank = min(results)
    return rank, results[rank]
