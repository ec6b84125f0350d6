"""A sweep through hydra/launcher=slurm from the login node: `-m wrap=ddp,fsdp2` is 2 Slurm jobs (one node x 2 tasks
each, side by side on c1 and c2), COMPLETED for sacct, one parent MLflow run with a FINISHED child per job, and the
summary table printed where it was submitted."""

import re

from cluster import fail, mlflow_runs, run, sacct_when_ended, submitit_job_ids, tags

CHECK = "sweep"
EXPERIMENT = "slurm-sweep"

done = run(CHECK, ["python", "-m", "hydraddp", "-m", "hydra/launcher=slurm", "wrap=ddp,fsdp2", "backend=gloo",
                   "tracking.uri=http://mlflow:5000", f"tracking.experiment={EXPERIMENT}", "trainer.max_steps=20"])
if done.returncode != 0:
    fail(CHECK, f"the command exited {done.returncode}")
summary = done.stdout.split("hydraddp sweep summary", 1)
if len(summary) != 2 or len(re.findall(r"^\s*\d+\s+ok\s", summary[1], re.M)) != 2:
    fail(CHECK, "no summary table with both jobs ok on the login node")

jobs = submitit_job_ids(CHECK)
if len(jobs) != 2:
    fail(CHECK, f"{len(jobs)} Slurm jobs submitted, not two: {jobs}")
states = {job: sacct_when_ended(job).get(job, {}).get("State") for job in jobs}
if set(states.values()) != {"COMPLETED"}:
    fail(CHECK, f"sacct says {states}")

runs = mlflow_runs(EXPERIMENT)
parents = [r for r in runs if "mlflow.parentRunId" not in tags(r)]
if len(parents) != 1:
    fail(CHECK, f"{len(parents)} parent runs, not one")
[parent] = parents
children = [r for r in runs if tags(r).get("mlflow.parentRunId") == parent["info"]["run_id"]]
wraps = sorted(tags(r).get("hydraddp.wrap", "?") for r in children)
statuses = {r["info"]["status"] for r in [parent, *children]}
if wraps != ["ddp", "fsdp2"] or statuses != {"FINISHED"}:
    fail(CHECK, f"children of wraps {wraps}, statuses {statuses}: not one FINISHED child per wrap")
print(f"slurm check {CHECK}: jobs {', '.join(jobs)} COMPLETED; parent run {parent['info']['run_id']} with FINISHED "
      f"children ddp and fsdp2; the summary table printed on the login node")
