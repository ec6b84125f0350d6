"""Preemption for real, through hydra/launcher=slurm: one job of 2 nodes x 1 task is stopped twice mid-run, first by
`scontrol requeue` (Slurm's SIGTERM to every task), then by `scancel --signal=USR2` (what Slurm sends before a time
limit or on preemption: submitit's handler requeues the job). Each time every rank checkpoints the same step and the
job comes back under the same Slurm job id and resumes; it finishes in the same MLflow run (tag hydraddp.requeued 2),
every step logged once, and its final parameters equal those of the same training run uninterrupted under srun."""

import json
import re
import subprocess
import time

import torch

from cluster import HOME, fail, mlflow_runs, run, sacct_when_ended, submitit_job_ids, tags

CHECK = "requeue"
EXPERIMENT = "slurm-requeue"
STEPS = 400
TRAINING = ["backend=gloo", "wrap=ddp", f"trainer.max_steps={STEPS}", "trainer.log_every=10", "trainer.eval_every=0",
            "checkpoint.save_last=true", "plan.record=false", "tracking.model.enabled=false"]


def rank0_log() -> str:
    logs = sorted((HOME / CHECK).glob("multirun/*/*/0/logs/rank0.log"))
    return logs[0].read_text() if logs else ""


def wait_for(what: str, condition, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            fail(CHECK, f"waited {timeout:g} s for {what}; rank 0's log ends:\n{rank0_log()[-2000:]}")
        time.sleep(0.2)


def logged_after(resumes: int, step: int) -> bool:
    """rank 0 logged a step at or past ``step`` after its ``resumes``-th resume."""
    text = rank0_log()
    parts = re.split(r"resumed from ", text)
    return len(parts) > resumes and any(int(s) >= step for s in re.findall(r"step (\d+) loss", parts[resumes]))


def state(job: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout.strip()
    return out or sacct_when_ended(job, timeout=0).get(job, {}).get("State", "")


def start_when_requeued(job: str) -> None:
    """A requeued job waits about two minutes (its BeginTime) before it starts again: start it now."""
    wait_for(f"job {job} to be requeued (PENDING)", lambda: state(job) == "PENDING", timeout=120)
    subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], check=True)


(HOME / CHECK).mkdir(parents=True, exist_ok=True)
print("$ python -m hydraddp hydra/launcher=slurm ... (in the background)", flush=True)
launch = subprocess.Popen(["python", "-m", "hydraddp", "hydra/launcher=slurm", "launcher.nnodes=2",
                           "launcher.nproc_per_node=1", *TRAINING, "tracking.uri=http://mlflow:5000",
                           f"tracking.experiment={EXPERIMENT}"], cwd=HOME / CHECK, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
try:
    wait_for("step 50", lambda: logged_after(0, 50))
    [job] = submitit_job_ids(CHECK)
    subprocess.run(["scontrol", "requeue", job], check=True)
    start_when_requeued(job)
    wait_for("step 100 after the first resume", lambda: logged_after(1, 100))
    first = int(re.search(r"resumed from \S+ at step (\d+)", rank0_log())[1])
    wait_for(f"a step 40 past the first preemption ({first})", lambda: logged_after(1, first + 40))
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    start_when_requeued(job)
    output, _ = launch.communicate(timeout=300)
finally:
    if launch.poll() is None:
        launch.kill()
print(output[-2000:], flush=True)
if launch.returncode != 0:
    fail(CHECK, f"the command exited {launch.returncode}; rank 0's log ends:\n{rank0_log()[-3000:]}")

[job_dir] = sorted(p.parent for p in (HOME / CHECK).glob("multirun/*/*/0/.hydra"))
preemptions = json.loads((job_dir / "preemptions.json").read_text())
if [p["signal"] for p in preemptions] != ["SIGTERM", "SIGUSR2"]:
    fail(CHECK, f"preemptions.json holds {preemptions}, not a SIGTERM then a SIGUSR2")
if sacct_when_ended(job).get(job, {}).get("State") != "COMPLETED":
    fail(CHECK, f"sacct says job {job} is {sacct_when_ended(job).get(job)}")
log = (job_dir / "logs" / "rank0.log").read_text()
for p in preemptions:
    if f"resumed from {p['checkpoint']} at step {p['step']}" not in log:
        fail(CHECK, f"rank 0 did not resume from {p['checkpoint']} at step {p['step']}")

[record] = mlflow_runs(EXPERIMENT)
if record["info"]["status"] != "FINISHED" or tags(record).get("hydraddp.requeued") != "2":
    fail(CHECK, f"the run is {record['info']['status']}, tag hydraddp.requeued {tags(record).get('hydraddp.requeued')}")

# The same training, uninterrupted, on the same 2 ranks over 2 nodes (srun: each task a rank), then both exported.
plain = run(CHECK, ["srun", "-N2", "--ntasks-per-node=1", "python", "-m", "hydraddp", *TRAINING,
                    "tracking.enabled=false", "hydra.run.dir=plain"])
if plain.returncode != 0:
    fail(CHECK, f"the uninterrupted run exited {plain.returncode}")


def final_params(job: str) -> dict:
    out = HOME / CHECK / f"{job.replace('/', '-')}.pt"
    done = run(CHECK, ["python", "-m", "hydraddp.export", str(HOME / CHECK / job / f"checkpoints/step_{STEPS:08d}"),
                       str(out)])
    if done.returncode != 0:
        fail(CHECK, f"the export of {job} exited {done.returncode}")
    return torch.load(out, weights_only=True)


expected, got = final_params("plain"), final_params(str(job_dir.relative_to(HOME / CHECK)))
difference = max((expected[k] - got[k]).abs().max().item() for k in expected)
if difference > 1e-6:
    # Every step each run logged, for the next reader of a failure: the cluster's volume goes with the test.
    steps = lambda text: re.findall(r"(step \d+ loss \S+|resumed from \S+ at step \d+)", text)  # noqa: E731
    fail(CHECK, f"the requeued run's final parameters differ from the uninterrupted run's by {difference:g}; "
                f"requeued: {steps(rank0_log())}; uninterrupted: "
                f"{steps((HOME / CHECK / 'plain' / 'logs' / 'rank0.log').read_text())}")
print(f"slurm check {CHECK}: job {job} requeued by scontrol at step {preemptions[0]['step']} and by USR2 at step "
      f"{preemptions[1]['step']}, resumed twice under the same job id into run {record['info']['run_id']} "
      f"(FINISHED, hydraddp.requeued 2); final parameters within {difference:g} of the uninterrupted run's")
