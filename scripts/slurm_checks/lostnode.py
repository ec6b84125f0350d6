"""A node lost mid-run: the sbatch example (srun, 2 nodes x 2 tasks, fsdp2) is running when c2 goes down
(`scontrol update nodename=c2 state=down`: Slurm ends the job's tasks on every node, as when a node stops answering).
The job ends (NODE_FAIL for sacct), no rank left running; relaunched on the remaining node alone with
checkpoint.resume=latest in the same job directory, it goes on from the last complete checkpoint (resharded from 4
ranks to 2; never a .tmp one) and finishes in the same MLflow run."""

import re
import subprocess
import time

from cluster import HOME, fail, mlflow_runs, sacct_when_ended, sbatch, submit, tags

CHECK = "lostnode"
EXPERIMENT = "slurm-lostnode"
TRAINING = ["trainer.max_steps=300", "trainer.log_every=10", "trainer.eval_every=0", "checkpoint.every_n_steps=40",
            f"tracking.experiment={EXPERIMENT}", "plan.record=false", "tracking.model.enabled=false"]

# --no-requeue: on a node's failure Slurm requeues a batch job by default (JobRequeue), and here the node answers
# again at once (ReturnToService=2); this job is to end, as on a cluster whose node stays lost.
job = submit(CHECK, "srun.sbatch", *TRAINING, options=("--no-requeue",))
job_dir = HOME / CHECK / "runs" / job
rank0 = job_dir / "logs" / "rank0.log"


def steps_logged() -> list[int]:
    return [int(s) for s in re.findall(r"step (\d+) loss", rank0.read_text())] if rank0.exists() else []


deadline = time.monotonic() + 240
while max(steps_logged(), default=0) < 130:  # past the checkpoint of step 120
    if time.monotonic() > deadline:
        fail(CHECK, f"job {job} did not reach step 130: {steps_logged()[-3:]}")
    time.sleep(0.2)
# Slurm ends the job's tasks on every node (c2 answers again at once: ReturnToService=2 puts it back).
subprocess.run(["scontrol", "update", "nodename=c2", "state=down", "reason=lost-node-check"], check=True)
lost_at = time.monotonic()
state = sacct_when_ended(job, timeout=120).get(job, {}).get("State", "")
ended_s = time.monotonic() - lost_at
if state != "NODE_FAIL":
    fail(CHECK, f"sacct says job {job} is {state!r} after c2 went down, not NODE_FAIL")
# sacct may say NODE_FAIL while squeue still shows the job COMPLETING (CG): c1's slurmd is still ending its tasks
# (SIGTERM, then SIGKILL after KillWait=10 s). No rank may outlive that.
while left := subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
    if time.monotonic() - lost_at > 90:
        fail(CHECK, f"job {job} is still in the queue 90 s after c2 went down: {left}")
    time.sleep(1)
# Slurm's SIGTERM reached the ranks before its SIGKILL: they may have checkpointed one more step together.
complete = sorted(p.name for p in (job_dir / "checkpoints").glob("step_*") if not p.name.endswith(".tmp"))
print(f"job {job} ended {state} {ended_s:.1f} s after c2 went down, left the queue "
      f"{time.monotonic() - lost_at:.1f} s after; complete checkpoints: {complete}", flush=True)

# Relaunched on c1 alone: the same script and job directory, its options overriding the script's.
sbatch(CHECK, "srun.sbatch", *TRAINING, "checkpoint.resume=latest", f"hydra.run.dir=runs/{job}",
       options=("-N1", "-w", "c1", "--ntasks-per-node=2"))
log = rank0.read_text()
resumed = re.findall(r"resumed from (\S+) at step (\d+)", log)
if not resumed or resumed[-1][0].rsplit("/", 1)[-1] != complete[-1] or complete[-1] < "step_00000120":
    fail(CHECK, f"the relaunch resumed from {resumed}, not the last complete checkpoint {complete[-1]}")
runs = mlflow_runs(EXPERIMENT)
if len(runs) != 1 or runs[0]["info"]["status"] != "FINISHED" or tags(runs[0]).get("hydraddp.world_size") != "2":
    fail(CHECK, f"MLflow holds {[(r['info']['status'], tags(r).get('hydraddp.world_size')) for r in runs]}, not one "
                "FINISHED run, continued at world size 2")
print(f"slurm check {CHECK}: job {job} ended {state} {ended_s:.1f} s after c2 was lost; relaunched on c1 it resumed "
      f"from {complete[-1]} (of 4 ranks, on 2) into the same FINISHED MLflow run {runs[0]['info']['run_id']}")
