"""One launch: the job's resolved config goes to every rank through ``hydraddp.distributed.Parallel``."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf

import hydraddp.distributed as idist
from hydraddp.job import Job, job_dir_from_agent

log = logging.getLogger(__name__)


def worker(local_rank: int, plain_cfg: dict[str, Any], job_dir: str, events_path: str | None,
           attached: bool, saved_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """What every rank runs: the config arrives resolved; it is never composed again here.

    ``events_path`` is where the tracker reads MLflow events; local rank 0 of the node that tracks writes them.
    """
    from hydraddp.tracking.events import EventWriter
    from hydraddp.tracking.node import NODE_DIR_ENV, write_node_file
    from hydraddp.train import host_heap, train
    from hydraddp.train.logs import FILE_ONLY, setup_rank_logging

    heap = host_heap.settle()  # first: before this rank's history decides glibc's thresholds

    # Each node's launcher (or, under torchrun, each process) made its own job directory: all take one.
    decides = idist.get_rank() == 0 if attached else plain_cfg["launcher"]["node_rank"] == 0 and local_rank == 0
    own_job_dir = job_dir
    job_dir, resume = agreed_start(own_job_dir, plain_cfg["checkpoint"]["resume"], decides)
    if not resume:
        from hydraddp.handoff.preemption import resume_point

        # Every rank reads the agreed directory (under torchrun the others composed in "."): all resume, or none.
        resume = resume_point(Path(job_dir))[0]
    plain_cfg = {**plain_cfg, "checkpoint": {**plain_cfg["checkpoint"], "resume": resume}}
    if idist.get_local_rank() == 0:
        # Which ranks ran on this node, for its tracker to upload their logs. Attached, the other nodes' ranks
        # composed in ".", the user's directory: their node file goes where this process's node tracker looks.
        node_dir = own_job_dir if not attached or idist.get_rank() == 0 else os.environ.get(NODE_DIR_ENV)
        node = idist.get_node_rank() if attached else plain_cfg["launcher"]["node_rank"]
        first = idist.get_rank() - idist.get_local_rank()
        if node_dir:
            write_node_file(Path(node_dir), node, Path(job_dir), list(range(first, first + idist.get_nproc_per_node())))
    setup_rank_logging(idist.get_rank(), Path(job_dir))
    log.info("rank %d pid %d%s", idist.get_rank(), os.getpid(), f"; {heap}" if heap else "")
    events = EventWriter(events_path) if events_path and idist.get_local_rank() == 0 else None
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if events is not None and restarts:
        events.tag("hydraddp.restarts", str(restarts))  # the run shows that torch's agent restarted the group
    try:
        result = train(OmegaConf.create(plain_cfg), Path(job_dir), events, saved_config)
        return {**result.to_dict(), "job_dir": job_dir}
    except Exception:
        log.exception("training failed", extra={FILE_ONLY: True})
        raise
    finally:
        if events is not None:
            events.close()


def from_decider(value: Callable[[], str], decides: bool) -> str:
    """``value()`` of the deciding process (node 0's local rank 0; rank 0 under torchrun), on every rank; only that
    process calls it."""
    if idist.get_world_size() == 1:
        return value()
    deciders = idist.all_gather(int(decides))
    src = deciders.index(1) if 1 in deciders else 0
    return idist.broadcast(value() if idist.get_rank() == src else "", src=src)


def agreed_start(proposed_job_dir: str, resume: str | None, decides: bool) -> tuple[str, str | None]:
    """One job directory and one checkpoint to resume for every rank of the launch, on every node and across
    restarts: the deciding process's job directory as the elastic agent keeps it, and the checkpoint its launcher
    found and checked (the others cannot resolve ``latest``: they do not know the agreed directory). Only the
    decider talks to the agent's store."""
    agreed = from_decider(lambda: json.dumps([job_dir_from_agent(proposed_job_dir) or proposed_job_dir, resume]),
                          decides)
    job_dir, agreed_resume = json.loads(agreed)
    return job_dir, agreed_resume


def parallel_for(plain: dict[str, Any]) -> idist.Parallel:
    backend, launcher = plain["backend"]["name"], plain["launcher"]
    if backend == "none":
        return idist.Parallel()  # one process, no group (ignite refuses sizes without a backend)
    # Attached (srun, a submitit task, torchrun), the outside launcher placed the ranks and gives the rendezvous: the
    # nodes and their address are its. (Parallel, as ignite's, refuses launcher.nnodes=2 without an address even then:
    # the README's multi-node hydra/launcher=slurm command failed so on every task.) nproc_per_node is still passed:
    # Parallel warns when it differs from the tasks the launcher started.
    attached = idist.detect_launch_env() is not None
    return idist.Parallel(
        backend=backend,
        nproc_per_node=launcher["nproc_per_node"],
        nnodes=None if attached else launcher["nnodes"],
        node_rank=None if attached else launcher["node_rank"],
        rdzv_endpoint=None if attached else launcher["rdzv_endpoint"],
        max_restarts=launcher["max_restarts"],
        start_method=idist.worker_start_method(backend, launcher["nnodes"], launcher["node_rank"]),
    )


def launch(job: Job, events_path: Path | None = None) -> tuple[int, dict[str, Any]]:
    """Run ``job`` on all ranks. Returns the lowest global rank this process saw (0 when it spawned the workers or
    is rank 0 under torchrun) and that rank's ``TrainResult``."""
    parallel = parallel_for(job.config)
    results = parallel.run(worker, job.config, str(job.job_dir), str(events_path) if events_path else None,
                           not parallel.spawns, job.saved_config)
    rank = min(results)
    return rank, results[rank]


def plan_recording(job: Job) -> Any:
    """The launch's plan for its MLflow run (``plan.record``; ``hydraddp.plan.record.Recording``), made beside the
    workers: forked where they are forked, so that it starts with torch imported; None for a wrap the simulated world
    does not run (DataParallel's replicas, Horovod's ranks), and for pipeline stages, which the plan does not cut."""
    from hydraddp.plan.record import PLANNED_WRAPS, Recording
    from hydraddp.tracking.names import PLAN_FILE

    if job.wrap not in PLANNED_WRAPS or job.config.get("mesh", {}).get("pp", 1) > 1:
        return None
    forked = idist.detect_launch_env() is None and idist.worker_start_method(job.config["backend"]["name"]) == "fork"
    return Recording(job.saved_config, job.world_size, job.job_dir / PLAN_FILE, fork=forked)
