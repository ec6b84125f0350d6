"""What the Slurm checks share (scripts/slurm_checks/*.py, run by scripts/slurm_test.sh with the image's Python on
ctl, the login node of deploy/slurm/compose.yml): running a command there, Slurm's accounting and MLflow's REST API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

HOME = Path("/cluster/home")  # the shared volume every node mounts: job directories, submitit's folders, checkpoints
MLFLOW = "http://mlflow:5000"  # the MLflow service, as the jobs reach it
# sacct's states of a job Slurm has not ended yet (a requeued job is PENDING again).
ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED"}


def fail(check: str, message: str) -> None:
    sys.exit(f"slurm check {check}: {message}")


def run(check: str, args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """``args`` on the login node in the check's own directory under HOME (its job directories apart from the other
    checks'), echoed, with its output kept (and shown when the check fails)."""
    cwd = HOME / check
    cwd.mkdir(parents=True, exist_ok=True)
    said = " ".join(args)
    for secret in filter(None, [os.environ.get("POSTGRES_PASSWORD")]):  # a study's storage URL holds it
        said = said.replace(secret, "***")
    print("$ " + said, flush=True)
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    print(done.stdout[-2000:] + done.stderr[-2000:], end="", flush=True)
    return done


def submitit_job_ids(check: str) -> list[str]:
    """The Slurm jobs submitit submitted for the check: its folders are multirun/DATE/TIME/.submitit/JOB_ID, where a
    sweep's jobs are one array's (JOB_ID_INDEX, e.g. 1_0 and 1_1, as sacct names them too, beside the array's own
    folder 1)."""
    names = {p.name for p in (HOME / check).glob("multirun/*/*/.submitit/*") if p.is_dir()}
    return sorted(name for name in names if not any(other.startswith(name + "_") for other in names))


def sacct(job_id: str) -> dict[str, dict[str, str]]:
    """Slurm's accounting of a job: its allocation (key JOB_ID) and each step (JOB_ID.batch, JOB_ID.0, ...)."""
    fields = ["JobID", "State", "NNodes", "NTasks", "NodeList", "ExitCode"]
    out = subprocess.run(["sacct", "-j", job_id, "-P", "-n", "-o", ",".join(fields)], capture_output=True, text=True,
                         check=True).stdout
    rows = [dict(zip(fields, line.split("|"))) for line in out.splitlines() if line]
    return {row["JobID"]: row for row in rows}


def sacct_when_ended(job_id: str, timeout: float = 120) -> dict[str, dict[str, str]]:
    """``sacct(job_id)`` once Slurm has ended the job. submitit returns as soon as every task has written its result,
    while Slurm still shows the job RUNNING (then COMPLETING) for a few seconds: its step and batch script end
    after."""
    deadline = time.monotonic() + timeout
    while True:
        accounted = sacct(job_id)
        state = accounted.get(job_id, {}).get("State", "")
        if state and state not in ACTIVE_STATES or time.monotonic() > deadline:
            return accounted
        time.sleep(1)


def _call(path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{MLFLOW}/api/2.0/mlflow{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def mlflow_runs(experiment: str) -> list[dict]:
    """Every run of the experiment, as MLflow's REST API gives them (info, data.metrics, data.tags)."""
    found = _call("/experiments/get-by-name?" + urllib.parse.urlencode({"experiment_name": experiment}))
    body = {"experiment_ids": [found["experiment"]["experiment_id"]], "max_results": 100}
    return _call("/runs/search", body).get("runs", [])


def metric_keys(run: dict) -> set[str]:
    return {m["key"] for m in run["data"].get("metrics", [])}


def tags(run: dict) -> dict[str, str]:
    return {t["key"]: t["value"] for t in run["data"].get("tags", [])}


def sbatch(check: str, script: str, *args: str, options: tuple[str, ...] = (), timeout: int = 300) -> str:
    """Submits one of the repository's sbatch scripts as written (``submit``) and waits until Slurm has ended the job
    (sacct, every second: ``sbatch --wait`` polls far less often). Returns its job id; the check fails, with the
    job's output, unless the job COMPLETED."""
    job = submit(check, script, *args, options=options)
    state = sacct_when_ended(job, timeout=timeout).get(job, {}).get("State")
    if state != "COMPLETED":
        output = "".join(p.read_text()[-3000:] for p in (HOME / check).glob(f"*-{job}.out"))
        fail(check, f"job {job} ({script}) is {state}, not COMPLETED:\n{output}")
    return job


def submit(check: str, script: str, *args: str, options: tuple[str, ...] = ()) -> str:
    """``sbatch [options] experiments/slurm/SCRIPT [args]`` from the check's directory; the job id."""
    done = run(check, ["sbatch", "--parsable", *options, f"/cluster/hydraddp/experiments/slurm/{script}", *args])
    job = done.stdout.strip().split(";")[0]
    if done.returncode != 0 or not job.isdigit():
        fail(check, f"sbatch {script} exited {done.returncode}")
    return job


def one_finished_run(check: str, experiment: str, world_size: int) -> dict:
    """The experiment's one MLflow run, FINISHED, at ``world_size``, with the sharding of every rank and the system
    metrics of each of the two nodes; the check fails, naming what is missing, otherwise."""
    runs = mlflow_runs(experiment)
    if len(runs) != 1:
        fail(check, f"{len(runs)} MLflow runs in {experiment}, not one")
    [record] = runs
    metrics = metric_keys(record)
    problems = [] if record["info"]["status"] == "FINISHED" else [f"the run is {record['info']['status']}"]
    problems += [f"no metric {key}" for key in (*(f"sharding/param_bytes/rank{r}" for r in range(world_size)),
                                                "train/loss") if key not in metrics]
    problems += [f"no system/{node}/* metric" for node in ("node0", "node1")
                 if not any(key.startswith(f"system/{node}/") for key in metrics)]
    if tags(record).get("hydraddp.world_size") != str(world_size):
        problems.append(f"tag hydraddp.world_size is {tags(record).get('hydraddp.world_size')}, not {world_size}")
    if problems:
        fail(check, "; ".join(problems))
    return record


def completed_on_both_nodes(check: str, job: str, tasks: int) -> dict:
    """sacct's record of the job's step 0, once Slurm has ended the job: COMPLETED, ``tasks`` tasks on c1 and c2."""
    accounted = sacct_when_ended(job)
    allocation, step = accounted.get(job, {}), accounted.get(f"{job}.0", {})
    if allocation.get("State") != "COMPLETED" or allocation.get("NNodes") != "2":
        fail(check, f"sacct says job {job} is {allocation}, not COMPLETED on 2 nodes")
    if step.get("State") != "COMPLETED" or step.get("NTasks") != str(tasks) or step.get("NodeList") != "c[1-2]":
        fail(check, f"sacct says the job's step is {step}, not {tasks} COMPLETED tasks on c[1-2]")
    return step
