"""The search on the cluster (issue 45's command with hydra/launcher=slurm), its study in PostgreSQL:
1. each trial is one Slurm job of 2 nodes x 1 task, 2 trials at a time; two good learning rates and then two that
   cannot learn are enqueued, and the median pruner stops a bad one on both nodes at the step it was evaluated at;
2. a sweeper killed mid-search (its trials' Slurm jobs left running) and run again finishes the study: the killed
   sweeper's trials are FAIL, their jobs stop at their next evaluation (the study ended them), none is left RUNNING
   and the study holds its 2 finished trials, both tried again."""

import os
import re
import signal
import subprocess
import time

import optuna
import psycopg2

from cluster import HOME, fail, mlflow_runs, run, sacct_when_ended, tags

CHECK = "search"
EXPERIMENT = "slurm-search"
LR = "optim.optimizer.lr"
DATABASE = "optuna"
USER, PASSWORD = os.environ["POSTGRES_USER"], os.environ["POSTGRES_PASSWORD"]
STORAGE = f"postgresql+psycopg2://{USER}:{PASSWORD}@postgres:5432/{DATABASE}"
SEARCH = ["python", "-m", "hydraddp", "-m", "hydra/sweeper=hydraddp_optuna", "hydra/launcher=slurm",
          "launcher.nnodes=2", "launcher.nproc_per_node=1", "backend=gloo", "hydra.sweeper.n_jobs=2",
          f"hydra.sweeper.storage={STORAGE}", "hydra.sweeper.pruner=median", "trainer.max_steps=60", "trainer.eval_every=10", "trainer.log_every=10", "plan.record=false",
          "tracking.model.enabled=false", "tracking.uri=http://mlflow:5000", f"tracking.experiment={EXPERIMENT}"]

admin = psycopg2.connect(host="postgres", user=USER, password=PASSWORD, dbname=os.environ["POSTGRES_DB"])
admin.autocommit = True  # CREATE DATABASE runs outside a transaction
with admin.cursor() as cursor:
    cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,))
    if not cursor.fetchone():
        cursor.execute(f"CREATE DATABASE {DATABASE}")
admin.close()
optuna.logging.set_verbosity(optuna.logging.WARNING)


def trial_jobs(sweep_dir: str) -> dict[int, str]:
    """trial number -> its Slurm job (submitit's folder in the trial's directory)."""
    found = {}
    for folder in (HOME / CHECK / sweep_dir).glob("trial-*/.submitit/*"):
        if folder.is_dir() and folder.name.isdigit():
            found[int(folder.parent.parent.name.removeprefix("trial-"))] = folder.name
    return found


# 1. Two trials at a time, each a 2-node job; pruning reaches both nodes.
created = optuna.create_study(study_name="enqueued", storage=STORAGE)
for lr in (0.1, 0.1, 1e-7, 1e-7):
    created.enqueue_trial({LR: lr})
done = run(CHECK, [*SEARCH, f"{LR}=tag(log, interval(1e-7, 1e-1))", "hydra.sweeper.n_trials=4",
                   "hydra.sweeper.study_name=enqueued", "hydra.sweep.dir=enqueued"], timeout=600)
if done.returncode != 0:
    fail(CHECK, f"the search exited {done.returncode}")
trials = optuna.load_study(study_name="enqueued", storage=STORAGE).get_trials()
states = [t.state.name for t in trials]
if states[:2] != ["COMPLETE", "COMPLETE"] or "PRUNED" not in states[2:] or "FAIL" in states:
    fail(CHECK, f"the study's trials are {states}: not two COMPLETE, then at least one PRUNED")
jobs = trial_jobs("enqueued")
accounted = {number: sacct_when_ended(job).get(job, {}) for number, job in jobs.items()}
if sorted(jobs) != [0, 1, 2, 3] or {a.get("NNodes") for a in accounted.values()} != {"2"}:
    fail(CHECK, f"the trials' Slurm jobs are {jobs}, on {[a.get('NNodes') for a in accounted.values()]} nodes: not "
                "one 2-node job per trial")
starts = sorted(subprocess.run(["sacct", "-j", ",".join(jobs.values()), "-X", "-n", "-P", "-o", "Start,End"],
                               capture_output=True, text=True, check=True).stdout.split())
spans = [line.split("|") for line in starts]
if not any(a[0] < b[1] and b[0] < a[1] for i, a in enumerate(spans) for b in spans[i + 1:]):
    fail(CHECK, f"no two trials' jobs ran at the same time: {spans}")
pruned = next(t for t in trials if t.state.name == "PRUNED")
logs = [p.read_text() for p in sorted((HOME / CHECK / "enqueued" / f"trial-{pruned.number}").glob("logs/rank*.log"))]
step = re.findall(r"stopping after step (\d+)", logs[0]) if logs else []
if len(logs) != 2 or not step or not all(f"stopping after step {step[0]}" in log for log in logs):
    fail(CHECK, f"trial {pruned.number} was PRUNED, but its {len(logs)} ranks' logs do not all stop at one step")
children = [r for r in mlflow_runs(EXPERIMENT) if tags(r).get("hydraddp.trial") is not None]
if sorted(int(tags(r)["hydraddp.trial"]) for r in children) != [0, 1, 2, 3]:
    fail(CHECK, f"MLflow holds trial runs {sorted(tags(r)['hydraddp.trial'] for r in children)}, not 0 to 3")
print(f"slurm check {CHECK}: 4 trials as 2-node jobs {', '.join(jobs.values())}, two at a time; {states}; trial "
      f"{pruned.number} pruned after step {step[0]} on both nodes", flush=True)

# 2. A sweeper killed mid-search, then run again.
again = [*SEARCH, "hydra.sweeper.n_trials=2", "hydra.sweeper.study_name=killed", "hydra.sweeper.heartbeat_interval=2",
         "hydra.sweeper.grace_period=10", "hydra.sweep.dir=killed", "trainer.max_steps=200", f"{LR}=0.05,0.1"]
print("$ " + " ".join(again).replace(PASSWORD, "***") + "   (killed once its trials train)", flush=True)
killed = subprocess.Popen(again, cwd=HOME / CHECK, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
deadline = time.monotonic() + 180
while len(list((HOME / CHECK / "killed").glob("trial-*/logs/rank0.log"))) < 2:
    if killed.poll() is not None or time.monotonic() > deadline:
        fail(CHECK, f"the sweeper's trials did not start training:\n{killed.communicate()[0][-2000:]}")
    time.sleep(0.5)
orphans = trial_jobs("killed")
os.killpg(killed.pid, signal.SIGKILL)
killed.wait()
done = run(CHECK, [*again[:-2], "trainer.max_steps=60", again[-1]], timeout=600)
if done.returncode != 0:
    fail(CHECK, f"the sweeper run again exited {done.returncode}")
states = [t.state.name for t in optuna.load_study(study_name="killed", storage=STORAGE).get_trials()]
if states.count("FAIL") != 2 or "RUNNING" in states or len(states) - states.count("FAIL") != 2:
    fail(CHECK, f"after the rerun the study holds {states}: not the 2 killed trials FAIL and 2 others finished")
left = {job: sacct_when_ended(job, timeout=120).get(job, {}).get("State") for job in orphans.values()}
if any(state in (None, "RUNNING", "PENDING") for state in left.values()):
    fail(CHECK, f"the killed sweeper's jobs did not stop: {left}")
print(f"slurm check {CHECK}: the killed sweeper's trials FAIL, their jobs ended {left}; the rerun finished the study: "
      f"{states}", flush=True)
