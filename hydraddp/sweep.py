"""The end of a ``-m`` sweep: one table of every job, and exit 1 if any job failed (an optuna search: if every
trial failed)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

# In an optuna search's sweep directory: how the sweeper's trials ended (``hydraddp.search.report.write_verdict``).
SEARCH_VERDICT_FILE = "search.json"


def _cell(value: Any, width: int, precision: int) -> str:
    return f"{value:{width}.{precision}f}" if isinstance(value, (int, float)) else "-".rjust(width)


def summary_table(outcomes: list[dict[str, Any]]) -> str:
    header = f"{'#':>2}  {'status':8} {'loss':>8} {'eval acc':>8} {'samples/s':>10}  overrides / error"
    lines = [header, "-" * len(header)]
    for num, out in enumerate(outcomes):
        detail = " ".join(out.get("overrides", []))
        if out.get("status") != "ok":
            detail += f"  ({out.get('error', '')})"
        lines.append(f"{num:>2}  {out.get('status', '?'):8} {_cell(out.get('final_loss'), 8, 4)} "
                     f"{_cell(out.get('eval_accuracy'), 8, 3)} {_cell(out.get('samples_per_s'), 10, 0)}  {detail}")
    return "\n".join(lines)


def submitit_launched(config: DictConfig) -> bool:
    """Whether ``hydra/launcher`` runs the jobs through submitit (``hydraddp.clusters.submitit.LAUNCHERS``)."""
    return "hydra_submitit_launcher" in str(config.hydra.launcher.get("_target_", ""))


def remote_launched(config: DictConfig) -> bool:
    """Whether ``hydra/launcher`` runs the jobs on other machines than this one (Slurm)."""
    return "SlurmLauncher" in str(config.hydra.launcher.get("_target_", ""))


def _single_job() -> bool:
    from hydraddp.clusters.submitit import SINGLE_JOB_ENV

    return os.environ.get(SINGLE_JOB_ENV) == "1"


def before_submission_problems(config: DictConfig, single_job: bool | None = None) -> list:
    """What must be refused before any job is submitted: a tracking file that jobs on other machines cannot write,
    and, for one launch through submitit (``single_job``; by default this command's), everything a local launch
    would refuse."""
    from hydraddp.clusters.submitit import REMOTE_LAUNCHERS
    from hydraddp.parallel.combinations import Problem

    found = []
    uri = str(config.tracking.uri or "")
    remote = remote_launched(config)
    if remote and config.tracking.enabled and not uri.startswith(("http://", "https://", "databricks")):
        found.append(Problem(("tracking.uri",), f"tracking.uri={uri or '(default: ./mlflow.db)'} is a file on this "
                             f"machine, and hydra/launcher ({'/'.join(REMOTE_LAUNCHERS)}) runs the jobs on others.",
                             "Point every job at one MLflow server: tracking.uri=http://HOST:PORT, or set "
                             "tracking.enabled=false."))
    if _single_job() if single_job is None else single_job:
        import copy

        from hydraddp.preflight.config import problems
        from hydraddp.preflight.settings import nproc_problems

        job = copy.deepcopy(config)  # as the job's nodes run it: nproc_per_node=auto is its tasks per node
        job.launcher.nproc_per_node = job.hydra.launcher.get("tasks_per_node", job.launcher.nproc_per_node)
        # Its tasks meet where submitit's environment says (the allocation's first node), not at launcher.rdzv_endpoint.
        found += nproc_problems(job) or problems(job, cluster_rendezvous=True)
    return found


def _read_outcomes(sweep_dir: Path) -> list[dict[str, Any]]:
    """The outcome each job of a sweep left in its directory (``handoff.launch_result.OUTCOME_FILE``), in job order."""
    import json

    from hydraddp.handoff.launch_result import OUTCOME_FILE

    files = sorted(sweep_dir.glob(f"*/{OUTCOME_FILE}"), key=lambda f: int(f.parent.name) if f.parent.name.isdigit()
                   else 0)
    # One job whose directory is the sweep's own (hydra.sweep.subdir=.): a search's trial (search.launch.trial_output).
    files += [f for f in [sweep_dir / OUTCOME_FILE] if f.exists()]
    return [json.loads(f.read_text()) for f in files]


def _search_verdict(sweep_dir: Path) -> dict[str, Any] | None:
    """How an optuna search's trials ended (``hydraddp.search.report.write_verdict``); None for a ``-m`` sweep."""
    import json

    path = sweep_dir / SEARCH_VERDICT_FILE
    return json.loads(path.read_text()) if path.exists() else None


def _report_single(outcome: dict[str, Any] | None) -> None:
    """One launch through submitit: say how it ended, with the contract's exit code."""
    from hydraddp.exit_codes import EXIT_INVALID, EXIT_PREEMPTED, EXIT_WORKER_FAILED, LaunchEnded

    if outcome is None:
        print("hydraddp: the submitit job left no outcome (see its log under .submitit/)", file=sys.stderr)
        raise LaunchEnded(EXIT_WORKER_FAILED)
    if outcome.get("status") == "ok":
        run = f" MLflow run {outcome['run_id']}." if outcome.get("run_id") else ""
        print(f"hydraddp: done (submitit job). {outcome['steps']} steps at world size {outcome['world_size']}: loss "
              f"{outcome['final_loss']:.4f}. Job directory: {outcome['job_dir']}.{run}", flush=True)
        return
    print(f"hydraddp: the submitit job ended {outcome.get('status')}: {outcome.get('error', '')}", file=sys.stderr)
    raise LaunchEnded({"invalid": EXIT_INVALID, "preempted": EXIT_PREEMPTED}.get(outcome.get("status"),
                                                                            EXIT_WORKER_FAILED))


class SweepSummary(Callback):
    """Prints the table, and keeps the sweep's MLflow parent run (its jobs' runs become its children). Through a
    submitit launcher, it also refuses what cannot work before anything is submitted, and reports one launch
    (no ``-m``) as a single launch."""

    def __init__(self) -> None:
        self.outcomes: list[dict[str, Any]] = []
        self.parent: Any = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if submitit_launched(config):
            from hydraddp.clusters.submitit import wait_for_every_job

            wait_for_every_job()  # a failed job (FailedJobError) is reported from its outcome.json, as the others
            found = before_submission_problems(config)
            if found:
                from hydraddp.exit_codes import EXIT_INVALID, LaunchEnded

                print("hydraddp: invalid configuration; nothing was submitted:", file=sys.stderr)
                for problem in found:
                    print(f"- {problem}", file=sys.stderr)
                raise LaunchEnded(EXIT_INVALID)
        if not config.tracking.enabled or _single_job():
            return
        import json

        from hydraddp.tracking.names import SWEPT_KEYS_ENV, swept_keys

        os.environ[SWEPT_KEYS_ENV] = json.dumps(swept_keys(config.hydra.overrides.task))  # names the jobs' runs
        from hydraddp.tracking.server import preflight
        from hydraddp.tracking.sweep_parent import SweepRun
        from hydraddp.tracking.setup import PARENT_RUN_ENV, tracking_uri

        from omegaconf import OmegaConf

        from hydraddp.redaction import redact_overrides, secret_paths

        uri = tracking_uri(config)
        if preflight(uri) is None:  # otherwise every job reports the unreachable server itself
            secrets = secret_paths(OmegaConf.to_container(config, resolve=False))
            overrides = redact_overrides(list(config.hydra.overrides.task), secrets)
            self.parent = SweepRun(uri, config.tracking.experiment, overrides)
            os.environ[PARENT_RUN_ENV] = self.parent.run_id

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if job_return.status == JobStatus.COMPLETED and isinstance(job_return._return_value, dict):
            self.outcomes.append(job_return._return_value)
        else:  # the task itself raised: keep the sweep going, show it as failed
            self.outcomes.append({"status": "failed", "error": repr(job_return._return_value),
                                  "overrides": list(job_return.overrides or [])})

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not self.outcomes:  # the jobs ran elsewhere (submitit): their outcomes are files
            self.outcomes = _read_outcomes(Path(config.hydra.sweep.dir))
        if _single_job():
            _report_single(self.outcomes[0] if self.outcomes else None)
            return
        search = _search_verdict(Path(config.hydra.sweep.dir))
        if search is not None:  # the search printed its own table; failed trials were tried again
            self.outcomes, failed = [], search["all_failed"]
        else:
            failed = any(out.get("status") != "ok" for out in self.outcomes)
        if self.parent is not None:
            from hydraddp.tracking.run import FAILED, FINISHED
            from hydraddp.tracking.setup import PARENT_RUN_ENV

            print(f"\nhydraddp sweep: MLflow parent run {self.parent.run_id} at {self.parent.uri}", flush=True)
            from hydraddp.tracking.names import SWEPT_KEYS_ENV

            self.parent.finish(FAILED if failed else FINISHED, Path(config.hydra.sweep.dir))
            os.environ.pop(PARENT_RUN_ENV, None)
            os.environ.pop(SWEPT_KEYS_ENV, None)
        if self.outcomes:
            print("\nhydraddp sweep summary\n" + summary_table(self.outcomes), flush=True)
        if failed:
            from hydraddp.exit_codes import EXIT_WORKER_FAILED, LaunchEnded

            raise LaunchEnded(EXIT_WORKER_FAILED)
