"""One MLflow run per launch, driven from the tracker process (``hydraddp.tracking.process``).

``start`` imports mlflow and creates (or continues) the run in a background thread while the workers start, then tails
the events file into the run in batches. ``finish`` flushes what is left, uploads the artifacts and sets
the status the launch really ended with. A server that goes away is retried; if it never comes back the
events stay in the job directory with the command that imports them.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from hydraddp.tracking import names, ui
from hydraddp.tracking.client import mlflow_client
from hydraddp.tracking.events import EVENTS_FILE, read_events
from hydraddp.tracking.node import upload_node_logs
from hydraddp.tracking.per_rank import PerRankTable

log = logging.getLogger(__name__)
SENT_OFFSET_FILE = "events.sent"
# MLflow's documented limits for one log_batch request: 1000 metrics, 100 params, 100 tags, 1000 in all.
MAX_METRICS, MAX_PARAMS, MAX_TAGS, MAX_ENTITIES = 1000, 100, 100, 1000
FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"
PLAN_CHECKED_KEYS = frozenset(names.PLAN_CHECKED.values())
# Events other than metrics and tags: their key names the module and function that log them, as
# ``handler(run: LaunchRun, payload: dict)``. A handler raises only when the server may be away (the event is then
# sent again); what it cannot log for good it logs as a warning and returns.
RECORD_HANDLERS = {"input": ("hydraddp.tracking.inputs", "log_input"),
                   "model": ("hydraddp.tracking.logged_model", "log_model")}


class LaunchRun:
    """The MLflow run of one launch.

    ``config`` is the resolved config with secrets redacted; ``tags`` the contract's tags.
    """

    def __init__(self, uri: str, experiment: str, job_dir: Path, config: dict[str, Any], overrides: list[str],
                 tags: dict[str, str], run_id: str | None = None, run_name: str | None = None, resuming: bool = False,
                 resumed_from: dict[str, Any] | None = None):
        """``resumed_from``: the checkpoint a resume starts from (``{"checkpoint": path, "step": N}``)."""
        self.uri, self.experiment, self.job_dir = uri, experiment, Path(job_dir)
        self.resumed_from = resumed_from
        self.config, self.overrides, self.tags = config, overrides, tags
        self.run_id, self.run_name = run_id, run_name
        self.experiment_id: str | None = None  # known once the run is created or found
        self.events_path = self.job_dir / EVENTS_FILE
        self._offset_path = self.job_dir / SENT_OFFSET_FILE
        # How far into the events file MLflow already has everything: a point is never sent twice.
        self._offset = int(self._offset_path.read_text()) if self._offset_path.exists() else 0
        self._sent = 0
        # The last step sent per metric: a step replayed after a restart or a resume is not logged twice.
        # A resume also asks the server how far the run got; a plain tracking.run_id=... just appends.
        self._last_step: dict[str, int] = {}
        self._resuming = resuming and run_id is not None
        self._appending = run_id is not None and not resuming
        self._unsure = False  # a request failed: did the server take it? Ask before sending again.
        self._read_back = False  # the server's latest steps were read
        self._until: int | None = None  # the end of this launch's events, once it has ended
        self._created = threading.Event()
        self._stop = threading.Event()  # the launch ended: send what is left, then return
        self._abort = threading.Event()  # finish() gave up waiting: return now
        self._thread: threading.Thread | None = None
        self._client: Any = None
        self._prior: Any = None  # a continued run as this launch found it
        self._active = False  # params, tags and status are this launch's
        # The launch's plan (plan.json's content, once the launcher's planning process wrote it: newer than this run
        # object, as an earlier launch's in this directory is not this one's); what the run measured of the parts it
        # predicts; and how far its logging got.
        self.plan: dict[str, Any] | None = None
        self._begun_at = time.time()
        self._measured: dict[str, float] = {}
        self._measured_step = 0
        self._plan_logged = self._plan_checked = False
        # Above tracking.per_rank_table_above ranks, per-rank values go to a table artifact instead of a key each.
        self._per_rank = PerRankTable.for_run(config, tags, self.job_dir)
        # Called with the run id once every event is sent and before the status is set (the node's system metrics).
        self.before_close: list[Any] = []

    def wait_created(self) -> None:
        """Until the run exists on the server (or forever, if it never does: callers are daemon threads)."""
        self._created.wait()

    # -- the background thread -------------------------------------------------------------------
    def start(self) -> None:
        """Create the run and send the events, in a thread."""
        self._thread = threading.Thread(target=self._run, name="hydraddp-mlflow", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        delay = 0.5
        while not self._created.is_set():
            try:
                self._create()
            except Exception as exc:  # the server may be restarting: keep trying until finish() gives up
                log.warning("MLflow run not created yet (%s); retrying", exc)
                if self._abort.wait(delay):
                    return
                delay = min(delay * 2, 5.0)
        if self.config and self.config.get("tracking", {}).get("model", {}).get("enabled"):
            from hydraddp.tracking.logged_model import warm_up

            try:
                warm_up()  # this process runs at nice 19: the ranks come first
            except Exception as exc:  # the logging itself says what is wrong, at the end
                log.debug("warming up the model's logging failed: %s", exc)
        while True:
            stopping = self._stop.is_set()
            try:
                drained = self._send_pending()
                if drained:
                    self._log_plan()
            except Exception as exc:
                if delay == 0.5:  # once per outage, not at every retry
                    log.warning("MLflow at %s unavailable (%s); points wait in %s and are sent when it is back",
                                self.uri, exc, self.events_path)
                if self._abort.wait(delay):
                    return
                delay = min(delay * 2, 5.0)
                continue
            delay = 0.5
            if stopping and drained:
                return
            self._stop.wait(0.5)

    def _create(self) -> None:
        client = self._client or mlflow_client(self.uri)
        self._client = client
        if self.run_id:  # continue an existing run (tracking.run_id=..., a resume, a restart under torchrun)
            # Left as it is until this launch takes a step: a launch that fails before that (a checkpoint of
            # another model, a bad learning rate) must not mark a FINISHED run FAILED.
            self._prior = client.get_run(self.run_id)
            self.experiment_id = self._prior.info.experiment_id
            ui.mark_training(client, client.get_experiment(self.experiment_id))
        else:
            experiment_id = self.experiment_id = ui.experiment_id(client, self.experiment)
            # {id} is the run's own id: known once the run exists, so the name is completed after creating it.
            first_name = names.run_name(self.run_name, {"id": ""}) if self.run_name else None
            self.run_id = client.create_run(experiment_id, tags=self.tags, run_name=first_name or None).info.run_id
            if self.run_name and "{id}" in self.run_name:
                self.run_name = names.run_name(self.run_name, {"id": self.run_id[:names.RUN_ID_CHARS]})
                client.update_run(self.run_id, name=self.run_name)
            self._record(self.tags)
        (self.job_dir / names.RUN_ID_FILE).write_text(self.run_id)
        self._created.set()
        log.info("MLflow run %s at %s", self.run_id, self.uri)

    def _record(self, tags: dict[str, str]) -> None:
        """The run's params (those it has not got: MLflow keeps a param's first value), tags and config."""
        from mlflow.entities import Param, RunTag

        flat = sorted(names.params(self.config).items())
        existing = self._client.get_run(self.run_id).data.params
        missing = [Param(k, v) for k, v in flat if k not in existing]
        tag_list = [RunTag(k, v) for k, v in tags.items()]
        for i in range(0, max(len(missing), len(tag_list), 1), MAX_PARAMS):
            self._client.log_batch(self.run_id, params=missing[i:i + MAX_PARAMS], tags=tag_list[i:i + MAX_TAGS])
        self._client.log_text(self.run_id, yaml.safe_dump(self.config, sort_keys=False), "config.yaml")
        self._client.log_text(self.run_id, yaml.safe_dump(self.overrides), "overrides.yaml")
        self._active = True

    def _activate(self) -> None:
        """A continued run takes part from this launch's first event on: RUNNING, and tagged with the settings
        it runs with now. A resume also appends what the run ran with before to ``hydraddp.resumed_from``."""
        if self._active:
            return
        self._client.update_run(self.run_id, status="RUNNING")
        tags = dict(self.tags)
        before = self._prior.data.tags if self._prior is not None else {}
        # A restart by torch's agent is recorded only where it changed what the run runs with (an elastic job
        # that lost a node goes on at a smaller world size); the tag hydraddp.restarts counts them all.
        changed = any(before.get(k) != tags.get(k) for k in names.CONTRACT_TAGS)
        if self.resumed_from is not None and ("restart" not in self.resumed_from or changed):
            history = json.loads(before.get(names.TAG_RESUMED_FROM, "[]"))
            history.append({**self.resumed_from, **{k.removeprefix("hydraddp."): before.get(k) for k in names.CONTRACT_TAGS}})
            tags[names.TAG_RESUMED_FROM] = json.dumps(history)[:names.MAX_TAG_LENGTH]
        self._record(tags)

    def _pending_count(self) -> int:
        events, _ = read_events(self.events_path, self._offset, until=self._until)
        return sum(1 for e in events if "metric" in e)

    def _send_pending(self) -> bool:
        """Send what the file holds past our offset, one request at a time within MLflow's limits, committing
        the offset after each accepted request; True when nothing was left.

        A request that failed may still have reached the server (a timeout): before sending again, the run's
        latest step per metric is read back, so no point is logged twice and none is skipped.
        """
        from mlflow.entities import Metric, RunTag

        events, ends = read_events(self.events_path, self._offset, with_ends=True, until=self._until)
        if not events:
            return True
        self._activate()
        if self._unsure:
            self._read_back_last_steps()
        metrics: list[Metric] = []
        tags: list[RunTag] = []
        pending_steps: dict[str, int] = {}
        sent_until = self._offset
        for event, end in zip(events, ends):
            if "metric" in event:
                key = event["metric"]
                if key in PLAN_CHECKED_KEYS:
                    self._measured[key], self._measured_step = event["value"], max(self._measured_step, event["step"])
                if self._per_rank.takes(event):
                    pass  # kept in the per-rank table, uploaded at the end
                elif event["step"] > pending_steps.get(key, self._last_logged(key)):
                    metrics.append(Metric(key, event["value"], event["ts"], event["step"]))
                    pending_steps[key] = event["step"]
            elif "tag" in event:
                tags.append(RunTag(event["tag"], event["value"]))
            else:  # a record: what came before it is sent first, then the record, each committed in turn
                self._send_batch(metrics, tags, pending_steps, sent_until)
                metrics, tags, pending_steps = [], [], {}
                self._handle_record(event)
                self._send_batch([], [], {}, end)
            sent_until = end
            full = len(metrics) == MAX_METRICS or len(tags) == MAX_TAGS or len(metrics) + len(tags) == MAX_ENTITIES
            if full or end == ends[-1]:
                self._send_batch(metrics, tags, pending_steps, end)
                metrics, tags, pending_steps = [], [], {}
        return False

    def _handle_record(self, event: dict[str, Any]) -> None:
        import importlib

        [(kind, payload)] = event.items()
        if kind not in RECORD_HANDLERS:
            log.warning("an event of unknown kind %r was left out", kind)
            return
        module, function = RECORD_HANDLERS[kind]
        getattr(importlib.import_module(module), function)(self, payload)

    def _send_batch(self, metrics: list, tags: list, steps: dict[str, int], end: int) -> None:
        if metrics or tags:
            self._unsure = True  # until the server says it took the request
            self._client.log_batch(self.run_id, metrics=metrics, tags=tags)
            self._unsure = False
        self._last_step.update(steps)
        self._per_rank.flush()  # before the offset moves past the per-rank values it took
        self._offset, self._sent = end, self._sent + len(metrics)
        tmp = self._offset_path.with_name(self._offset_path.name + ".tmp")
        tmp.write_text(str(end))
        os.replace(tmp, self._offset_path)  # atomic: a crash leaves the old offset or the new one

    def _read_back_last_steps(self) -> None:
        """The run's latest step of every metric, as the server holds it (MLflow keeps the highest step)."""
        self._unsure, self._read_back = False, True
        if self._appending:
            return  # a plain tracking.run_id continuation logs its steps again on purpose: nothing to compare
        latest = getattr(self._client.get_run(self.run_id).data, "_metric_objs", [])
        for metric in latest:
            self._last_step[metric.key] = max(self._last_step.get(metric.key, -1), metric.step)

    def _last_logged(self, key: str) -> int:
        if key not in self._last_step and self._resuming and not self._read_back:
            self._read_back_last_steps()  # a resume or a restart: the run may hold these steps already
        return self._last_step.setdefault(key, -1)

    def _log_plan(self) -> None:
        """The plan's params and plan.json once it is ready, then ``plan/error/*`` once the run has measured every part
        it checks (run by the sending thread, and by ``finish`` for a plan that came late)."""
        from mlflow.entities import Metric, Param

        if self.plan is None:
            self.plan = self._written_plan()
        if self.plan is None or not self._active:
            return
        if not self._plan_logged:
            existing = self._client.get_run(self.run_id).data.params  # a continued run keeps its first plan
            params = [Param(k, v) for k, v in names.plan_params(self.plan).items() if k not in existing]
            self._client.log_batch(self.run_id, params=params)
            self._client.log_text(self.run_id, json.dumps(self.plan, indent=2), names.PLAN_FILE)
            self._plan_logged = True
        errors = None if self._plan_checked else names.plan_errors(self.plan, self._measured)
        if errors:
            now = int(time.time() * 1000)
            self._client.log_batch(self.run_id, metrics=[Metric(k, v, now, self._measured_step) for k, v in errors.items()])
            self._plan_checked = True

    def _written_plan(self) -> dict[str, Any] | None:
        path = self.job_dir / names.PLAN_FILE
        try:
            return json.loads(path.read_text()) if path.stat().st_mtime >= self._begun_at else None
        except (OSError, ValueError):  # not written yet
            return None

    # -- the end of the launch -------------------------------------------------------------------
    def finish(self, status: str, error: str | None = None, timeout_s: float = 60.0) -> bool:
        """Flush every event, upload artifacts, set ``status``. False (with a message) if the server never came back."""
        # What the launch wrote ends here: after a restart the next attempt appends to the same file, and its
        # own tracker sends that part.
        self._until = self.events_path.stat().st_size if self.events_path.exists() else 0
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._abort.set()
            self._thread.join()
        try:
            if not self._created.is_set():
                raise RuntimeError("the run was never created")
            while not self._send_pending():  # anything the thread had no time for
                pass
            if not self._active:
                print(f"hydraddp: the launch ended ({status}) before its first step; MLflow run {self.run_id} "
                      f"keeps its status {self._prior.info.status}.", flush=True)
                return True
            try:
                self._log_plan()
            except Exception as exc:  # the plan is the run's extra: it never costs the run its status
                log.warning("the launch's plan was not logged (%s)", exc)
            for close in self.before_close:
                close(self.run_id)
            self._upload_artifacts(error)
            self._print_link()
            self._client.set_terminated(self.run_id, status)  # MLflow prints its own links after ours
            return True
        except Exception as exc:
            pending = self._pending_count()
            print(f"hydraddp: MLflow at {self.uri} did not come back ({exc}). {pending} metric points are kept in "
                  f"{self.events_path}; send them (and the {status} status) with:\n"
                  f"  python -m hydraddp.tracking.sync {self.job_dir} --uri {self.uri} --status {status}", flush=True)
            (self.job_dir / "mlflow_status").write_text(status)
            return False

    def _print_link(self) -> None:
        """The run's page in the UI, or nothing for a sweep's job (the sweep prints its runs at the end)."""
        base = ui.ui_base(self.uri)
        if base is None or names.TAG_PARENT in self.tags:
            return
        link = ui.run_url(base, self.experiment_id, self.run_id)
        print("hydraddp: the run in MLflow's UI:\n"
              + ui.open_lines(self.uri, [("the run", link)]), flush=True)

    def _upload_artifacts(self, error: str | None) -> None:
        self._per_rank.upload(self)
        report = self.job_dir / "wrap_report.json"
        if report.exists():
            self._client.log_artifact(self.run_id, str(report))
        upload_node_logs(self._client, self.run_id, self.job_dir)  # the other nodes upload theirs
        if error:
            self._client.set_tag(self.run_id, names.TAG_ERROR, error[:5000])
            self._client.log_text(self.run_id, error, "error.txt")


def sync(job_dir: Path, uri: str, status: str | None) -> int:
    """Send a job directory's events to its run (the command ``finish`` prints when a server stayed away)."""
    run_id = (job_dir / names.RUN_ID_FILE).read_text().strip()
    run = LaunchRun(uri, "", job_dir, {}, [], {}, run_id=run_id, resuming=True)  # the last request may have landed
    run._client = mlflow_client(uri)
    run._prior, run._active = run._client.get_run(run_id), True  # the launch did run: its points are real
    run._created.set()
    while not run._send_pending():
        pass
    run._upload_artifacts(None)
    if status:
        run._client.set_terminated(run_id, status)
    print(f"hydraddp: sent {run._sent} metric points to run {run_id}")
    return 0
