"""The two sbatch examples, submitted as written (experiments/slurm/): srun's 2 nodes x 2 tasks, each task a rank that
attaches to Slurm's variables; and one torchrun agent per node under srun, 2 workers each, attached to torchrun. Each
is one COMPLETED Slurm job and one FINISHED MLflow run at world size 4, with both nodes' system metrics."""

from cluster import completed_on_both_nodes, one_finished_run, sbatch

CHECK = "srun"
for script, tasks in (("srun.sbatch", 4), ("torchrun.sbatch", 2)):  # torchrun: one task (agent) per node
    experiment = f"slurm-{script.split('.')[0]}"
    job = sbatch(CHECK, script, "trainer.max_steps=20", f"tracking.experiment={experiment}")
    step = completed_on_both_nodes(CHECK, job, tasks=tasks)
    record = one_finished_run(CHECK, experiment, world_size=4)
    print(f"slurm check {CHECK}: {script} as written: job {job} COMPLETED ({step['NTasks']} tasks on "
          f"{step['NodeList']}); MLflow run {record['info']['run_id']} FINISHED at world size 4")
