"""The README's multi-node command through hydra/launcher=slurm, submitted from the login node: one Slurm job of 2 nodes
x 2 tasks (4 ranks, the rendezvous from the allocation), COMPLETED for sacct, and one FINISHED MLflow run with the
sharding of ranks 0-3 and the system metrics of both nodes."""

from cluster import completed_on_both_nodes, fail, one_finished_run, run, submitit_job_ids

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
step = completed_on_both_nodes(CHECK, job, tasks=4)
record = one_finished_run(CHECK, EXPERIMENT, world_size=4)
print(f"slurm check {CHECK}: job {job} COMPLETED ({step['NTasks']} tasks on {step['NodeList']}); MLflow run "
      f"{record['info']['run_id']} FINISHED with sharding/*/rank0-3 and the system metrics of node0 and node1")
