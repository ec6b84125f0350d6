"""Every node's part in the launch's one MLflow run: its system metrics and its ranks' logs.

Node 0's tracker keeps the run (``hydraddp.tracking.process``), tagged with the launch's job directory. Beside every
other node's launcher, ``python -m hydraddp.tracking.node`` (nice 19) finds that run on the server by that tag (the
ranks never wait for it: at nice 19 the run may only exist once a short launch has ended), samples the node's system
metrics into it and, at the end, uploads the node's rank logs under ``logs/node{N}/``.

Which rank logs are a node's, and the launch's job directory: the node's local rank 0 writes ``node.json``
(``write_node_file``) into the job directory its launcher made, naming the node, the launch's agreed job directory
and the node's global ranks.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from hydraddp.tracking import names
from hydraddp.tracking.client import default_uri, mlflow_client

log = logging.getLogger(__name__)
NODE_FILE = "node.json"
RUN_POLL_S = 2.0  # how often a node asks the server for the launch's run until it exists
NODE_DIR_ENV = "HYDRADDP_NODE_DIR"  # attached: where this node's local rank 0 writes the node file (``for_launch``)


def write_node_file(own_job_dir: Path, node: int, agreed_job_dir: Path, ranks: list[int]) -> None:
    """Called by a node's local rank 0: which ranks ran here, and where their logs are."""
    own_job_dir.mkdir(parents=True, exist_ok=True)
    (own_job_dir / NODE_FILE).write_text(json.dumps({"node": node, "job_dir": str(agreed_job_dir), "ranks": ranks}))


def node_logs(job_dir: Path) -> tuple[int, list[Path]]:
    """The node of ``job_dir`` and its ranks' log files. Without a node file (the workers never started), the node is
    node 0 and the logs are every rank log in ``job_dir``."""
    info_path = job_dir / NODE_FILE
    if not info_path.exists():
        return 0, sorted((job_dir / "logs").glob("rank*.log"))
    info = json.loads(info_path.read_text())
    logs = Path(info["job_dir"]) / "logs"
    return info["node"], [logs / f"rank{r}.log" for r in info["ranks"] if (logs / f"rank{r}.log").exists()]


def upload_node_logs(client: Any, run_id: str, job_dir: Path) -> None:
    node, logs = node_logs(job_dir)
    for path in logs:
        client.log_artifact(run_id, str(path), f"logs/node{node}")


def find_run(client: Any, experiment: str, job_dir: str) -> str | None:
    """The newest run of ``experiment`` tagged with the launch's job directory, or None yet."""
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return None
    runs = client.search_runs([found.experiment_id], f"tags.`{names.TAG_JOB_DIR}` = '{job_dir}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None


def for_launch(job: Any, tracker: Any) -> NodeTracker | None:
    """This node's process, started, on every node but node 0 (whose ``tracker`` keeps the run) of a launch over
    several nodes. ``finish()`` it when the launch ended.

    Under hydraddp's launchers it is each node's launcher that starts it. Attached to torchrun or Slurm there is no
    launcher of ours: each node's local rank 0 starts it, beside itself. Its ranks composed in the user's directory,
    where nothing is written, so the node file goes to a private directory (``NODE_DIR_ENV``) that ``finish`` removes.
    """
    from hydraddp.distributed.env import detect_launch_env

    if not job.config["tracking"]["enabled"] or tracker is not None:
        return None
    attached = detect_launch_env()
    if attached is None:
        if job.config["launcher"]["nnodes"] < 2:
            return None
        node = NodeTracker(settings_for(job, job.config["launcher"]["node_rank"], job.job_dir))
    else:
        if attached.nnodes < 2 or attached.local_rank != 0 or attached.node_rank == 0:
            return None
        node_dir = Path(tempfile.mkdtemp(prefix=f"hydraddp-node{attached.node_rank}-"))
        os.environ[NODE_DIR_ENV] = str(node_dir)  # read by this process's worker (``hydraddp.launch.worker``)
        node = NodeTracker(settings_for(job, attached.node_rank, node_dir), private_dir=node_dir)
    node.start()
    return node


def settings_for(job: Any, node: int, job_dir: Path) -> dict[str, Any]:
    """A node process's settings, from the launch's ``Job`` on that node; ``job_dir`` is where it finds the node
    file."""
    tracking = job.config["tracking"]
    return {"uri": tracking["uri"] or default_uri(), "experiment": tracking["experiment"], "job_dir": str(job_dir),
            "node": node, "system_metrics": dict(tracking["system_metrics"]),
            "continued": bool(job.resumes or tracking["run_id"]), "upload_timeout_s": tracking["flush_timeout_s"]}


class NodeTracker:
    """A node's launcher (not node 0's) and its node process: ``start`` before the launch, ``finish`` after it."""

    def __init__(self, settings: dict[str, Any], private_dir: Path | None = None):
        """``settings``: uri, job_dir (this launcher's), node, system_metrics ({enabled, interval_s}), continued.
        ``private_dir``: removed by ``finish``."""
        self.settings = settings
        self._private_dir = private_dir
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
        self._proc = subprocess.Popen([sys.executable, "-m", "hydraddp.tracking.node"], stdin=subprocess.PIPE,
                                      text=True, **group)
        self._proc.stdin.write(json.dumps(self.settings) + "\n")
        self._proc.stdin.flush()

    def finish(self, timeout_s: float = 60.0) -> None:
        """The launch ended: the node process logs its last sample and the node's logs, then exits."""
        try:
            self._proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self._proc.wait(timeout=timeout_s + 30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)


def _wait_for_run(settings: dict[str, Any], ended: threading.Event) -> tuple[str | None, Path]:
    """The run this node's launch logs into, found once the workers wrote the node file (until the launch ended and
    the upload's timeout passed), and the launch's job directory."""
    node_file, deadline = Path(settings["job_dir"], NODE_FILE), None
    while not node_file.exists():
        # Looked at again once the launch ended: a short launch can write the file and end within one poll.
        if ended.wait(RUN_POLL_S) and not node_file.exists():
            return None, Path(settings["job_dir"])  # the workers never started
    job_dir = json.loads(node_file.read_text())["job_dir"]
    client = mlflow_client(settings["uri"])
    while True:
        try:
            run_id = find_run(client, settings["experiment"], job_dir)
            if run_id:
                return run_id, Path(settings["job_dir"])
        except Exception as exc:  # the server may be restarting
            log.debug("run not found yet (%s)", exc)
        if ended.is_set():
            deadline = deadline or time.monotonic() + settings["upload_timeout_s"]
            if time.monotonic() > deadline:
                return None, Path(settings["job_dir"])
        ended.wait(RUN_POLL_S)


def main() -> int:
    import signal

    from hydraddp.tracking.system_metrics import NodeSystemMetrics

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher ends us by closing stdin, after its workers
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.nice(19)
    settings = json.loads(sys.stdin.readline())
    ended = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), ended.set()), daemon=True).start()
    run_id, job_dir = _wait_for_run(settings, ended)
    if run_id is None:
        print(f"hydraddp: node {settings['node']}: no MLflow run of this launch was found at {settings['uri']}; its "
              f"logs stay in {job_dir}", file=sys.stderr, flush=True)
        return 1
    metrics = None
    if settings["system_metrics"]["enabled"]:
        metrics = NodeSystemMetrics(settings["uri"], settings["node"], settings["system_metrics"]["interval_s"],
                                    settings["continued"])
        metrics.start(run_id)
    ended.wait()
    if metrics is not None:
        metrics.finish(run_id)
    deadline = time.monotonic() + settings["upload_timeout_s"]
    while True:
        try:
            upload_node_logs(mlflow_client(settings["uri"]), run_id, job_dir)
            return 0
        except Exception as exc:  # the server may be restarting
            if time.monotonic() > deadline:
                print(f"hydraddp: node {settings['node']}: logs not uploaded to MLflow run {run_id} ({exc}); they "
                      f"stay in {job_dir}", file=sys.stderr, flush=True)
                return 1
            time.sleep(1.0)


if __name__ == "__main__":
    from hydraddp.exit_codes import exit_without_teardown

    exit_without_teardown(main)
