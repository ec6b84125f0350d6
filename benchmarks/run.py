"""Measure hydraddp side by side with a plain torchrun script, PyTorch-Ignite and Lightning Fabric, and print the ratios.

    .venv/bin/python benchmarks/run.py            # about 30 minutes on 2 cores; writes results.json, RESULTS.md
    .venv/bin/python benchmarks/run.py --pairs 7  # more rounds
    .venv/bin/python benchmarks/run.py --smoke --json /tmp/r.json --no-markdown   # seconds: does the harness run?

Every figure is a ratio of two runs taken in the same round. Rounds interleave the variants (the order flips
every round, so a drift in the machine's speed hits both sides alike), and each figure reports the
min / median / max of its per-round ratios. Nothing here is a test: these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import workload  # noqa: E402

PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
NPROC = 2
BIG_HIDDEN = (4096,) * 7  # about 101M parameters: the peak-RSS comparison


@dataclass(frozen=True)
class Settings:
    pairs: int = 5
    steps: int = 130  # WARMUP_STEPS, then 120 steady steps: shorter windows left the noise at about 5%
    hidden: tuple[int, ...] = workload.HIDDEN
    big_hidden: tuple[int, ...] = BIG_HIDDEN
    big_steps: int = 3
    # WARMUP_STEPS, then 90 steady steps (about 30 s): 30 left one HF fsdp2 run between 0.86 and 1.08 of its pair
    hf_steps: int = 100
    import_pairs: int = 10
    loop_steps: tuple[int, int] = (100, 500)  # the loop's own cost: (wall at N2 steps - wall at N1) / (N2 - N1)


# No loop group in the smoke run: the difference of two tiny runs' walls is start-up jitter, and can be negative.
SMOKE = Settings(pairs=1, steps=12, hidden=(32, 32), big_hidden=(64, 64), big_steps=2, hf_steps=12, import_pairs=1,
                 loop_steps=())


@dataclass
class Variant:
    """One program, run once per round in a new ``run_dir``: ``command(run_dir)`` gives its argv; its rank 0
    leaves a result file. (hydraddp overrides may say ``{run_dir}``.)"""

    name: str
    what: str
    command: Callable[[Path], list[str]]
    result_file: Callable[[Path], Path]
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Measurement:
    startup_s: float  # from starting the command to the end of the first optimizer step
    wall_s: float
    steady_samples_per_s: float
    peak_memory_bytes: list[int]
    shard_bytes: list[int]  # param + grad + optimizer state per rank (hydraddp's WrapReport)
    final_loss: float


def _hidden(hidden: tuple[int, ...]) -> str:
    return "[" + ",".join(map(str, hidden)) + "]"


def hydraddp_variant(name: str, what: str, settings: Settings, *overrides: str, nproc: int = NPROC,
                     hidden: tuple[int, ...] | None = None, steps: int | None = None,
                     env: dict[str, str] | None = None) -> Variant:
    def command(run_dir: Path) -> list[str]:
        return [PYTHON, "-m", "hydraddp", f"hydra.run.dir={run_dir}", f"launcher.nproc_per_node={nproc}",
                f"model.hidden={_hidden(hidden or settings.hidden)}",
                f"data.batch_size={workload.BATCH_PER_RANK * nproc}", f"trainer.max_steps={steps or settings.steps}",
                "trainer.eval_every=0", *(o.format(run_dir=run_dir) for o in overrides)]

    return Variant(name, what, command, lambda run_dir: run_dir / "result.json", env or {})


def plain_variant(name: str, what: str, settings: Settings, *args: str, nproc: int = NPROC,
                  env: dict[str, str] | None = None, steps: int | None = None) -> Variant:
    def command(run_dir: Path) -> list[str]:
        launcher = [TORCHRUN, f"--nproc_per_node={nproc}"] if nproc > 1 else [PYTHON]
        return [*launcher, str(HERE / "plain_torchrun.py"), "--steps", str(steps or settings.steps),
                "--hidden", *map(str, settings.hidden), "--out", str(run_dir / "result.json"), *args]

    return Variant(name, what, command, lambda run_dir: run_dir / "result.json", env or {})


def peer_variant(name: str, what: str, script: str, settings: Settings) -> Variant:
    """A framework peer (ignite, Fabric): its own launcher, the workload, hydraddp's DDP arguments."""
    def command(run_dir: Path) -> list[str]:
        return [PYTHON, str(HERE / script), "--nproc", str(NPROC), "--steps", str(settings.steps),
                "--hidden", *map(str, settings.hidden), "--out", str(run_dir / "result.json")]

    # torchrun's rule, which neither ignite's spawn nor Fabric's launcher applies: without it two ranks fight over
    # each core.
    return Variant(name, what, command, lambda run_dir: run_dir / "result.json", {"OMP_NUM_THREADS": "1"})


def hf_variants(settings: Settings) -> list[Variant]:
    """The Hugging Face Llama (workload.HF_SIZES) under ddp and fsdp2: hydraddp's model=hf_causal_lm, and the plain
    script building the same model through transformers, with the same DDP arguments and FSDP2 units."""
    sizes = [f"model.{key}={value}" for key, value in workload.HF_SIZES.items()]
    batch = f"data.batch_size={workload.HF_BATCH_PER_RANK * NPROC}"

    def hydraddp_hf(wrap: str) -> Variant:
        def command(run_dir: Path) -> list[str]:
            return [PYTHON, "-m", "hydraddp", f"hydra.run.dir={run_dir}", f"launcher.nproc_per_node={NPROC}",
                    "model=hf_causal_lm", *sizes, batch, f"trainer.max_steps={settings.hf_steps}", "trainer.eval_every=0",
                    f"wrap={wrap}", "tracking.enabled=false"]

        return Variant(f"hydraddp-hf-{wrap}", f"hydraddp model=hf_causal_lm wrap={wrap}", command,
                       lambda run_dir: run_dir / "result.json")

    def plain_hf(wrap: str, *args: str) -> Variant:
        def command(run_dir: Path) -> list[str]:
            return [TORCHRUN, f"--nproc_per_node={NPROC}", str(HERE / "plain_torchrun.py"), "--model", "hf",
                    "--steps", str(settings.hf_steps), "--wrap", wrap, *args, "--out", str(run_dir / "result.json")]

        return Variant(f"plain-hf-{wrap}", f"plain script, transformers Llama, {wrap}", command,
                       lambda run_dir: run_dir / "result.json")

    return [hydraddp_hf("ddp"), plain_hf("ddp", "--bucket-view"), hydraddp_hf("fsdp2"),
            plain_hf("fsdp2", "--units", "blocks")]


def groups(settings: Settings, db_uri: str) -> dict[str, list[Variant]]:
    """The variants, in groups whose members are interleaved round by round."""
    off = "tracking.enabled=false"
    # Everything a tracked run does: a point every step, system metrics (every 2 s here, 10 s by default), the
    # dataset inputs, the plan and the logged model at the end.
    every_step = ("trainer.log_every=1", f"tracking.uri={db_uri}", "tracking.system_metrics.interval_s=2")
    one_thread = {"OMP_NUM_THREADS": "1"}
    return {
        "ddp": [
            # Every peer gets hydraddp's DDP arguments (gradient_as_bucket_view): the ratios measure frameworks.
            plain_variant("plain-ddp", "plain torchrun script, DDP(gradient_as_bucket_view=True)", settings,
                          "--wrap", "ddp", "--bucket-view"),
            peer_variant("ignite-ddp", "PyTorch-Ignite Parallel + auto_model (DDP)", "ignite_train.py", settings),
            peer_variant("fabric-ddp", "Lightning Fabric, DDPStrategy", "fabric_train.py", settings),
            hydraddp_variant("hydraddp-ddp", "hydraddp wrap=ddp, tracking off", settings, "wrap=ddp", off),
            hydraddp_variant("hydraddp-ddp-no-bucket-view", "hydraddp wrap=ddp without its default bucket view",
                             settings, "wrap=ddp", "wrap.kwargs.gradient_as_bucket_view=false", off),
            hydraddp_variant("hydraddp-ddp-mlflow", "hydraddp ddp, MLflow (database exists): every step, system "
                             "metrics every 2 s, datasets, plan, model",
                             settings, "wrap=ddp", *every_step),
            hydraddp_variant("hydraddp-ddp-mlflow-fresh", "hydraddp ddp, MLflow into a new database, every step",
                             settings, "wrap=ddp", "trainer.log_every=1", "tracking.uri=sqlite:///{run_dir}/new.db"),
            plain_variant("plain-1proc", "plain script, one process, one thread", settings, "--wrap", "none",
                          nproc=1, env=one_thread),
            hydraddp_variant("hydraddp-1proc", "hydraddp backend=none, one process, one thread", settings,
                             "backend=none", "wrap=none", off, nproc=1, env=one_thread),
        ],
        "fsdp": [
            hydraddp_variant("hydraddp-fsdp2", "hydraddp wrap=fsdp2 (default auto-wrap)", settings, "wrap=fsdp2", off),
            plain_variant("plain-fsdp2-root", "plain script, fully_shard(model)", settings, "--wrap", "fsdp2",
                          "--units", "root"),
            plain_variant("plain-fsdp2-linear", "plain script, fully_shard on every Linear", settings, "--wrap",
                          "fsdp2", "--units", "linear"),
            hydraddp_variant("hydraddp-fsdp", "hydraddp wrap=fsdp (FSDP1)", settings, "wrap=fsdp", off),
        ],
        "hf": hf_variants(settings),
        # One process, one thread, the same work (tracking off, evaluation only at the end), at two lengths: the
        # difference of the wall times is the steps' own cost, with start-up and the final evaluation cancelled.
        "loop": [variant for steps in settings.loop_steps for variant in (
            plain_variant(f"plain-1proc-{steps}", f"plain script, one process, one thread, {steps} steps", settings,
                          "--wrap", "none", nproc=1, env=one_thread, steps=steps),
            hydraddp_variant(f"hydraddp-1proc-{steps}", f"hydraddp backend=none, one process, {steps} steps",
                             settings, "backend=none", "wrap=none", off, nproc=1, env=one_thread, steps=steps))],
        "memory": [
            hydraddp_variant(f"hydraddp-{wrap}-100M", f"hydraddp wrap={wrap}, ~100M-parameter MLP", settings,
                             f"wrap={wrap}", off, "trainer.log_every=1", hidden=settings.big_hidden,
                             steps=settings.big_steps)
            for wrap in ("ddp", "fsdp2")
        ],
    }


def measure(variant: Variant, work: Path) -> Measurement:
    run_dir = Path(tempfile.mkdtemp(prefix=f"{variant.name}-", dir=work))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(variant.env)
    began = time.time()
    proc = subprocess.run(variant.command(run_dir), cwd=work, env=env, capture_output=True, text=True)
    wall = time.time() - began
    if proc.returncode != 0:
        sys.exit(f"benchmarks: {variant.name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(variant.result_file(run_dir).read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    shards = [r["param_bytes"] + r["grad_bytes"] + r["optim_state_bytes"] for r in result.get("reports", [])]
    return Measurement(result["first_step_at"] - began, wall, result["steady_samples_per_s"],
                       result["peak_memory_bytes"], shards, result["final_loss"])


def allreduce_cpu_s(settings: Settings, work: Path) -> float:
    """One DDP gradient allreduce of the workload's MLP, alone: this rank's CPU seconds (benchmarks/allreduce_cost.py)."""
    out = work / "allreduce.json"
    subprocess.run([TORCHRUN, f"--nproc_per_node={NPROC}", str(HERE / "allreduce_cost.py"), "--hidden",
                    *map(str, settings.hidden), "--out", str(out)], cwd=work, check=True, capture_output=True)
    return json.loads(out.read_text())["cpu_s"]


def import_seconds(statement: str) -> float:
    began = time.perf_counter()
    subprocess.run([PYTHON, "-c", statement], check=True, cwd=ROOT)
    return time.perf_counter() - began


IMPORTS = {
    "import-torch": "import torch",
    "import-hydraddp": "import hydraddp",
    "import-hydraddp-core": "from hydraddp.distributed import auto_model",
}


def run_rounds(variants: list[Variant], rounds: int, work: Path, log: Callable[[str], None]) -> dict[str, list]:
    results: dict[str, list] = {v.name: [] for v in variants}
    for index in range(rounds):
        order = variants if index % 2 == 0 else variants[::-1]
        for variant in order:
            m = measure(variant, work)
            results[variant.name].append(m)
            log(f"  round {index + 1}/{rounds} {variant.name:28s} start {m.startup_s:5.2f} s  "
                f"steady {m.steady_samples_per_s:8.0f} samples/s")
    return results


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


@dataclass(frozen=True)
class Figure:
    key: str
    label: str
    target: str  # ">= 0.99", "<= 1.10", or "" (reported)
    ratios: list[float]

    def verdict(self) -> str:
        if not self.target:
            return "reported"
        op, bound = self.target.split()
        median = statistics.median(self.ratios)
        ok = median >= float(bound) if op == ">=" else median <= float(bound)
        return "met" if ok else "MISSED"


def ceilings(r: dict[str, list[Measurement]], allreduce_s: list[float], one: str) -> list[float]:
    """Per round, the scaling 2 ranks on 2 cores can reach: one-thread step time / (that + the allreduce's CPU)."""
    return [(workload.BATCH_PER_RANK / m.steady_samples_per_s) /
            (workload.BATCH_PER_RANK / m.steady_samples_per_s + cost) for m, cost in zip(r.get(one, []), allreduce_s)]


def step_seconds(r: dict[str, list[Measurement]], program: str, steps: tuple[int, int]) -> list[float]:
    """Per round, ``program``'s seconds per step measured from outside: the wall time of the long run less the short
    run's, over the steps between (start-up and the final evaluation are in both)."""
    short, long = (r.get(f"{program}-{n}", []) for n in steps)
    return [(b.wall_s - a.wall_s) / (steps[1] - steps[0]) for a, b in zip(short, long)]


def figures(r: dict[str, list[Measurement]], imports: dict[str, list[float]],
            allreduce_s: list[float] | None = None, loop_steps: tuple[int, int] = Settings.loop_steps) -> list[Figure]:
    def per_round(a: str, b: str, fa: Callable, fb: Callable | None = None) -> list[float]:
        return [fa(x) / (fb or fa)(y) for x, y in zip(r.get(a, []), r.get(b, []))]

    steady = lambda m: m.steady_samples_per_s  # noqa: E731
    startup = lambda m: m.startup_s  # noqa: E731
    max_shard = lambda m: max(m.shard_bytes)  # noqa: E731
    max_peak = lambda m: max(m.peak_memory_bytes)  # noqa: E731
    every = [
        Figure("steady_ddp", "samples/s, ddp: hydraddp / plain", ">= 0.99", per_round("hydraddp-ddp", "plain-ddp", steady)),
        Figure("steady_fsdp2", "samples/s, fsdp2 (same units): hydraddp / plain", ">= 0.99",
               per_round("hydraddp-fsdp2", "plain-fsdp2-root", steady)),
        Figure("steady_ignite", "samples/s, ddp: ignite / plain", "", per_round("ignite-ddp", "plain-ddp", steady)),
        Figure("steady_fabric", "samples/s, ddp: Lightning Fabric / plain", "",
               per_round("fabric-ddp", "plain-ddp", steady)),
        Figure("steady_hf_ddp", "samples/s, HF Llama ddp: hydraddp / plain", ">= 0.99",
               per_round("hydraddp-hf-ddp", "plain-hf-ddp", steady)),
        Figure("steady_hf_fsdp2", "samples/s, HF Llama fsdp2 (same units): hydraddp / plain", ">= 0.99",
               per_round("hydraddp-hf-fsdp2", "plain-hf-fsdp2", steady)),
        Figure("default_bucket_view", "samples/s, hydraddp's default: ddp with bucket view / without", "",
               per_round("hydraddp-ddp", "hydraddp-ddp-no-bucket-view", steady)),
        Figure("startup_mlflow", "start to 1st step: hydraddp+MLflow+plan (db exists) / plain", "<= 1.00",
               per_round("hydraddp-ddp-mlflow", "plain-ddp", startup)),
        Figure("startup_fresh_db", "start to 1st step: hydraddp+MLflow (new db) / plain", "",
               per_round("hydraddp-ddp-mlflow-fresh", "plain-ddp", startup)),
        Figure("startup_off", "start to 1st step: hydraddp, tracking off / plain", "",
               per_round("hydraddp-ddp", "plain-ddp", startup)),
        Figure("startup_ignite", "start to 1st step: ignite / plain", "", per_round("ignite-ddp", "plain-ddp", startup)),
        Figure("startup_fabric", "start to 1st step: Lightning Fabric / plain", "",
               per_round("fabric-ddp", "plain-ddp", startup)),
        Figure("scaling_hydraddp", "ddp scaling: hydraddp 2 ranks / (2 x 1 proc, 1 thread)", ">= 0.92",
               per_round("hydraddp-ddp", "hydraddp-1proc", steady, lambda m: 2 * m.steady_samples_per_s)),
        Figure("scaling_plain", "ddp scaling: plain 2 ranks / (2 x 1 proc, 1 thread)", "",
               per_round("plain-ddp", "plain-1proc", steady, lambda m: 2 * m.steady_samples_per_s)),
        Figure("scaling_hydraddp_ceiling", "ddp scaling: hydraddp / the allreduce's ceiling", ">= 0.95",
               [a / c for a, c in zip(per_round("hydraddp-ddp", "hydraddp-1proc", steady,
                                                 lambda m: 2 * m.steady_samples_per_s),
                                       ceilings(r, allreduce_s or [], "hydraddp-1proc"))]),
        Figure("scaling_plain_ceiling", "ddp scaling: plain / the allreduce's ceiling", "",
               [a / c for a, c in zip(per_round("plain-ddp", "plain-1proc", steady, lambda m: 2 * m.steady_samples_per_s),
                                       ceilings(r, allreduce_s or [], "plain-1proc"))]),
        Figure("fsdp2_autowrap", "samples/s: hydraddp fsdp2 default / fully_shard per Linear", ">= 1.2",
               per_round("hydraddp-fsdp2", "plain-fsdp2-linear", steady)),
        Figure("shard_fsdp2", "p+g+optim bytes per rank: fsdp2 / ddp", "<= 0.51",
               per_round("hydraddp-fsdp2", "hydraddp-ddp", max_shard)),
        Figure("shard_fsdp", "p+g+optim bytes per rank: fsdp / ddp", "<= 0.51",
               per_round("hydraddp-fsdp", "hydraddp-ddp", max_shard)),
        Figure("peak_rss_100m", "peak RSS per rank, ~100M params: fsdp2 / ddp", "",
               per_round("hydraddp-fsdp2-100M", "hydraddp-ddp-100M", max_peak)),
        Figure("logging_cost", "samples/s: MLflow (every step, system metrics, datasets, model) / tracking off",
               ">= 0.99",
               per_round("hydraddp-ddp-mlflow", "hydraddp-ddp", steady)),
        Figure("import_cost", "import hydraddp / import torch", "<= 1.05",
               [a / b for a, b in zip(imports["import-hydraddp"], imports["import-torch"])]),
        Figure("import_core", "import hydraddp.distributed.auto_model / import torch", "",
               [a / b for a, b in zip(imports["import-hydraddp-core"], imports["import-torch"])]),
    ]
    if loop_steps:
        every.insert(0, Figure(
            "loop_cost", f"seconds per step, one process (wall at {loop_steps[1]} - at {loop_steps[0]} steps): "
            "hydraddp / plain", "<= 1.03", [a / b for a, b in zip(step_seconds(r, "hydraddp-1proc", loop_steps),
                                                                 step_seconds(r, "plain-1proc", loop_steps))]))
    return [f for f in every if f.ratios]  # --only leaves some out


def machine() -> dict[str, str]:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    # A measurement of uncommitted code names no commit: `run.py --check` then calls the results stale.
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "hydraddp", "benchmarks", ":!benchmarks/RESULTS.md",
                            ":!benchmarks/results.json"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "cores": str(os.cpu_count()), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "commit": commit.stdout.strip() + ("-dirty" if dirty else ""),
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def table(figs: list[Figure]) -> str:
    rows = ["| figure | target | min | median | max | pairs | |", "|---|---|---|---|---|---|---|"]
    for f in figs:
        s = spread(f.ratios)
        rows.append(f"| {f.label} | {f.target or '-'} | {s['min']:.3f} | {s['median']:.3f} | {s['max']:.3f} | "
                    f"{s['n']} | {f.verdict()} |")
    return "\n".join(rows)


def absolutes(r: dict[str, list[Measurement]], descriptions: dict[str, str]) -> str:
    rows = ["| variant | start to 1st step (s) | steady samples/s | peak RSS per rank (MB) | p+g+optim per rank (MB) |",
            "|---|---|---|---|---|"]
    for name, ms in r.items():
        shard = f"{statistics.median(max(m.shard_bytes) for m in ms) / 2**20:.1f}" if ms[0].shard_bytes else "-"
        rows.append(f"| {name}: {descriptions[name]} | {statistics.median(m.startup_s for m in ms):.2f} | "
                    f"{statistics.median(m.steady_samples_per_s for m in ms):,.0f} | "
                    f"{statistics.median(max(m.peak_memory_bytes) for m in ms) / 2**20:,.0f} | {shard} |")
    return "\n".join(rows)


BEGIN, END = "<!-- benchmarks/run.py writes from here -->", "<!-- to here -->"


def update_markdown(path: Path, text: str) -> None:
    """Replace the generated block of RESULTS.md; the analysis around it is written by hand and kept."""
    old = path.read_text() if path.exists() else f"# Benchmark results\n\n{BEGIN}\n{END}\n"
    head, _, rest = old.partition(BEGIN)
    _, _, tail = rest.partition(END)
    path.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def staleness(markdown: Path = HERE / "RESULTS.md", root: Path = ROOT) -> tuple[str | None, list[str]]:
    """The commit RESULTS.md measured, and the files under hydraddp/ and benchmarks/ changed since (the results
    themselves aside), committed or not. No commit named (a measurement of uncommitted code) is ``(None, [])``."""
    header = next((line for line in markdown.read_text().splitlines() if line.startswith("Measured ")), "")
    named = re.search(r"hydraddp ([0-9a-f]{7,40});", header)
    if not named:
        return None, []
    git = lambda *args: subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)  # noqa: E731
    if git("cat-file", "-e", f"{named[1]}^{{commit}}").returncode != 0:
        raise SystemExit(f"RESULTS.md measured {named[1]}, which this checkout's history does not hold")
    # Against the working tree: uncommitted changes make it stale too.
    changed = git("diff", "--name-only", named[1], "--", "hydraddp", "benchmarks",
                  ":!benchmarks/RESULTS.md", ":!benchmarks/results.json").stdout.split()
    return named[1], changed


def check(markdown: Path) -> int:
    """``--check``: 0 when RESULTS.md describes the code at HEAD, 1 (naming what changed) when it is stale."""
    commit, changed = staleness(markdown)
    if commit is None:
        print(f"{markdown} names no clean commit it measured: run benchmarks/run.py at a commit and commit what it writes")
        return 1
    if changed:
        print(f"{markdown} is stale: it measured {commit}; since then {len(changed)} files under hydraddp/ and "
              f"benchmarks/ changed, e.g. {', '.join(changed[:5])}. Run benchmarks/run.py and commit what it writes.")
        return 1
    print(f"{markdown} is current: it measured {commit}, and nothing it measured has changed since.")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=Settings.pairs, help="rounds (A/B pairs) per figure, at least 5")
    parser.add_argument("--smoke", action="store_true", help="a tiny configuration, one round: the harness runs")
    parser.add_argument("--json", type=Path, default=HERE / "results.json")
    parser.add_argument("--markdown", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--no-markdown", dest="markdown", action="store_const", const=None)
    parser.add_argument("--only", help="comma-separated groups (ddp, fsdp, memory, imports); implies --no-markdown")
    parser.add_argument("--check", action="store_true",
                        help="measure nothing: say whether RESULTS.md is stale (exit 1) or describes HEAD (exit 0)")
    args = parser.parse_args(argv)
    if args.check:
        return check(args.markdown or HERE / "RESULTS.md")
    settings = SMOKE if args.smoke else Settings(pairs=args.pairs)
    only = set(args.only.split(",")) if args.only else None
    if only:
        args.markdown = None  # RESULTS.md holds whole runs only
    log = lambda line: print(line, flush=True)  # noqa: E731

    began = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="hydraddp-bench-"))
    try:
        db_uri = f"sqlite:///{work}/mlflow.db"
        plan = groups(settings, db_uri)
        descriptions = {v.name: v.what for vs in plan.values() for v in vs}
        # One untimed run of each program: page cache, compiled bytecode, and the database that "exists".
        # (--smoke times nothing that it reports, so it needs none.)
        for variant in () if args.smoke else (plan["ddp"][0], plan["ddp"][1], plan["ddp"][3]):
            log(f"warm-up: {variant.name}")
            measure(variant, work)
        results: dict[str, list[Measurement]] = {}
        for name, variants in plan.items():
            if only and name not in only:
                continue
            rounds = settings.pairs if name != "memory" else min(settings.pairs, 2)
            log(f"{name}: {len(variants)} variants x {rounds} rounds")
            results.update(run_rounds(variants, rounds, work, log))
        allreduce_s = [allreduce_cpu_s(settings, work) for _ in range(settings.pairs if "plain-1proc" in results else 0)]
        imports: dict[str, list[float]] = {name: [] for name in IMPORTS}
        for index in range(settings.import_pairs if not only or "imports" in only else 0):
            for name, statement in (IMPORTS.items() if index % 2 == 0 else reversed(IMPORTS.items())):
                imports[name].append(import_seconds(statement))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    figs = figures(results, imports, allreduce_s, settings.loop_steps)
    info = machine()
    header = (f"Measured {info['date']} on {info['cpu']} ({info['cores']} cores), Python {info['python']}, "
              f"torch {info['torch']}, hydraddp {info['commit']}; CPU, gloo, {NPROC} ranks; "
              f"{settings.pairs} interleaved rounds; {time.perf_counter() - began:.0f} s in all.")
    imports_row = " ".join(f"{name} {statistics.median(v):.2f} s;" for name, v in imports.items() if v)
    text = (f"{header}\n\n{table(figs)}\n\nMedians per variant:\n\n{absolutes(results, descriptions)}\n\n"
            f"Import times (median): {imports_row}\n")
    print("\n" + text)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "machine": info, "settings": settings.__dict__,
        "figures": [{"key": f.key, "label": f.label, "target": f.target, "verdict": f.verdict(),
                     **spread(f.ratios), "ratios": f.ratios} for f in figs],
        "variants": {name: [m.__dict__ for m in ms] for name, ms in results.items()},
        "imports_s": imports, "allreduce_cpu_s": allreduce_s,
    }, indent=1))
    if args.markdown is not None:
        update_markdown(args.markdown, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
