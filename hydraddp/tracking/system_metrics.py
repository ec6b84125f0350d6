"""MLflow's own system-metrics monitor (CPU, memory, disk, network; GPUs through NVML where nvidia-ml-py is
installed), one per node, each under ``system/node{N}/...`` of the launch's one run. It samples in the node's tracker
process, never in a training rank."""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger(__name__)


def node_name(node: int) -> str:
    return f"node{node}"


class NodeSystemMetrics:
    """``start`` once the run exists; ``finish`` before the run is closed (MLflow's monitor stops by itself once the run
    is no longer RUNNING)."""

    def __init__(self, uri: str, node: int, interval_s: float, continued: bool):
        """``continued``: the run has system metrics of an earlier launch already; their steps go on from there."""
        self.uri, self.node, self.interval_s, self.continued = uri, node_name(node), interval_s, continued
        self._monitor: Any = None
        self._lock, self._started = threading.Lock(), False

    def start(self, run_id: str) -> None:
        with self._lock:
            if not self._started:
                self._start(run_id)

    def _start(self, run_id: str) -> None:
        self._started = True
        # Its start and stop are INFO lines on the launch's console, between the ranks' own: only trouble is shown.
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._monitor = SystemMetricsMonitor(run_id, sampling_interval=self.interval_s, resume_logging=self.continued,
                                                 node_id=self.node, tracking_uri=self.uri)
            self._monitor.start()
        except Exception as exc:  # psutil missing, the server away: the run goes on without them
            log.warning("system metrics of %s are not logged (%s)", self.node, exc)
            self._monitor = None

    def finish(self, run_id: str) -> None:
        """Stop sampling and log the last sample: MLflow's monitor drops a sample taken since it last logged, so a
        launch shorter than one interval (or than the run's creation, on a busy machine) would have none."""
        with self._lock:
            if not self._started:
                self._start(run_id)  # one sample, now
            monitor, self._monitor = self._monitor, None
        if monitor is None:
            return
        monitor.finish()
        try:
            last = monitor.aggregate_metrics()
            if last:
                monitor.publish_metrics(last)
                monitor.mlflow_logger.flush()
        except Exception as exc:
            log.warning("the last system metrics sample of %s was not logged (%s)", self.node, exc)
