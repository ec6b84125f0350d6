"""No rank waits for a peer that refused: under a real srun (2 nodes x 1 task), rank 0 finds the checkpoint it must
resume unreadable (as a requeued job can) and exits 2; rank 1, on the other node, is told on rank 0's store and
exits 1 at once, naming rank 0's reason, far inside launcher.timeout. Slurm sees the step FAILED."""

import re
import subprocess
import time

from cluster import HOME, fail, run, sacct_when_ended

CHECK = "refusal"
TIMEOUT_S = 300
checkpoint = HOME / CHECK / "run" / "checkpoints" / "step_00000010"
checkpoint.mkdir(parents=True, exist_ok=True)
(checkpoint / "meta.json").write_text("{not json")  # a write cut short, a file system that lost it

started = time.monotonic()
done = run(CHECK, ["srun", "-N2", "--ntasks-per-node=1", "--label", "--job-name=refusal", "python", "-m", "hydraddp",
                   "backend=gloo", "tracking.enabled=false", "plan.record=false", f"checkpoint.resume={checkpoint}",
                   f"launcher.timeout={TIMEOUT_S}", "hydra.run.dir=run"], timeout=TIMEOUT_S)
wall = time.monotonic() - started
told = "rank 1 stopped before training: rank 0 refused to start: invalid configuration"
if done.returncode == 0 or told not in done.stderr or "unreadable meta.json" not in done.stderr:
    fail(CHECK, f"srun exited {done.returncode}; rank 1 was not told of rank 0's refusal")
if re.search(r"^1: .*Traceback", done.stderr, re.M):
    fail(CHECK, "rank 1 ended in a traceback")
if wall > TIMEOUT_S / 2:
    fail(CHECK, f"the step took {wall:.0f} s: rank 1 waited for the timeout ({TIMEOUT_S} s), it was not told")
listed, deadline = [], time.monotonic() + 60  # slurmdbd records a job a moment after srun returns
while not listed and time.monotonic() < deadline:
    listed = subprocess.run(["sacct", "-X", "-n", "-P", "--name=refusal", "-o", "JobID"], capture_output=True,
                            text=True, check=True).stdout.split()
    time.sleep(0.5)
state = sacct_when_ended(listed[-1]).get(listed[-1], {}).get("State") if listed else None
if state != "FAILED":
    fail(CHECK, f"sacct says the job is {state}, not FAILED")
print(f"slurm check {CHECK}: rank 0 refused its checkpoint (exit 2), rank 1 on the other node was told and exited "
      f"1; the job ended after {wall:.1f} s (launcher.timeout={TIMEOUT_S} s), FAILED for sacct")
