"""The README's multi-node command through hydra/launcher=slurm, submitted from the login node: one Slurm job of 2 nodes
x 2 tasks (4 ranks, the rendezvous from the allocation), COMPLETED for sacct, and one FINISHED MLflow run with the
sharding of ranks 0-3 and the system metrics of both nodes."""

from cluster import fail, metric_keys, mlflow_runs, run, sacct_when_ended, submitit_job_ids, tags

CHECK = "submit"
EXPERIMENT = "slurm-submit"

done = run(CHECK, ["python", "-m", "hydraddp", "hydra/launcher=slurm", "launcher.nnodes=2", "launcher.nproc_per_node=2",
                   "backend=gloo", "wrap=fsdp2", "tracking.uri=http://mlflow:5000",
                   f"tracking.experiment={EXPERIMENT}", "trainer.max_steps=20"])
if done.returncode != 0:
    fail(CHECK, f"the command exited {done.returncode}")
if "20 steps at world size 4" not in done.stdout + done.stderr:
    fail(CHECK, "no done line of 20 steps at world size 4")

jobs = submitit_job_ids(CHECK)
if len(jobs) != 1:
    fail(CHECK, f"{len(jobs)} Slurm jobs submitted, not one: {jobs}")
[job] = jobs
accounted = sacct_when_ended(job)
allocation, step = accounted.get(job, {}), accounted.get(f"{job}.0", {})
if allocation.get("State") != "COMPLETED" or allocation.get("NNodes") != "2":
    fail(CHECK, f"sacct says job {job} is {allocation}, not COMPLETED on 2 nodes")
if step.get("State") != "COMPLETED" or step.get("NTasks") != "4" or step.get("NodeList") != "c[1-2]":
    fail(CHECK, f"sacct says the job's step is {step}, not 4 COMPLETED tasks on c[1-2]")

runs = mlflow_runs(EXPERIMENT)
if len(runs) != 1:
    fail(CHECK, f"{len(runs)} MLflow runs in {EXPERIMENT}, not one")
[record] = runs
metrics = metric_keys(record)
problems = [] if record["info"]["status"] == "FINISHED" else [f"the run is {record['info']['status']}"]
problems += [f"no metric {key}" for key in (*(f"sharding/param_bytes/rank{r}" for r in range(4)), "train/loss")
             if key not in metrics]
problems += [f"no system/{node}/* metric" for node in ("node0", "node1")
             if not any(key.startswith(f"system/{node}/") for key in metrics)]
if tags(record).get("hydraddp.world_size") != "4":
    problems.append(f"tag hydraddp.world_size is {tags(record).get('hydraddp.world_size')}, not 4")
if problems:
    fail(CHECK, "; ".join(problems))
print(f"slurm check {CHECK}: job {job} COMPLETED ({step['NTasks']} tasks on {step['NodeList']}); MLflow run "
      f"{record['info']['run_id']} FINISHED with sharding/*/rank0-3 and the system metrics of node0 and node1")
