"""A checkpoint root claimed on one node refuses a launch from another (hydraddp.lease: a file created with O_EXCL on
the shared volume, not flock, which locks on each node alone on common cluster mounts). A launch on c1 holds
checkpoint.dir; the same launch on c2 exits 2 naming the holder, before anything trains; c1's goes on."""

import subprocess
import time

from cluster import HOME, fail, run

CHECK = "claim"
ROOT = HOME / CHECK / "checkpoints"
LAUNCH = ["python", "-m", "hydraddp", "backend=gloo", f"checkpoint.dir={ROOT}", "tracking.enabled=false",
          "plan.record=false", "trainer.log_every=100"]

(HOME / CHECK).mkdir(parents=True, exist_ok=True)
print("$ srun -w c1 ... (in the background: it holds the claim until cancelled)", flush=True)
holder = subprocess.Popen(["srun", "-N1", "-n1", "-w", "c1", "--job-name=claim-holder", *LAUNCH,
                           "trainer.max_steps=1000000", "hydra.run.dir=c1"], cwd=HOME / CHECK,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
try:
    deadline = time.monotonic() + 120
    while not (HOME / CHECK / "c1" / "logs" / "rank0.log").exists() or "training steps" not in \
            (HOME / CHECK / "c1" / "logs" / "rank0.log").read_text():
        if holder.poll() is not None or time.monotonic() > deadline:
            fail(CHECK, f"the launch on c1 did not start training:\n{holder.communicate()[0][-2000:]}")
        time.sleep(0.2)
    second = run(CHECK, ["srun", "-N1", "-n1", "-w", "c2", *LAUNCH, "trainer.max_steps=10", "hydra.run.dir=c2"])
finally:
    subprocess.run(["scancel", "--name=claim-holder"], check=False)
    holder.communicate(timeout=120)
if second.returncode != 2:
    fail(CHECK, f"the launch on c2 exited {second.returncode}, not 2")
if f"checkpoint.dir={ROOT} is in use by another launch that is running now" not in second.stderr \
        or "Traceback" in second.stderr:
    fail(CHECK, f"the launch on c2 was not refused with the claim's message:\n{second.stderr[-2000:]}")
if (HOME / CHECK / "c2" / "logs").exists():
    fail(CHECK, "the refused launch on c2 started a rank")
print(f"slurm check {CHECK}: with checkpoint.dir claimed on c1, the launch on c2 exited 2 before any rank started: "
      + second.stderr.strip().splitlines()[0][:200])
