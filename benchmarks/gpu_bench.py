"""The GPU benchmark: bf16 DDP and FSDP2 on hydraddp's GPT, hydraddp ÷ a plain torchrun script, and MFU.

    python benchmarks/gpu_bench.py [--rounds 2] [--json benchmarks/results-gpu.json] [--markdown benchmarks/RESULTS-gpu.md]

Then the 808M GPT (2048x16, seq 1024, 8 sequences per GPU) and the 1024x12 GPT with ``trainer.compile`` off and on:
hydraddp alone, whose MFU and compile gain are the figures.

tests/gpu/run.sh runs it after the GPU tests, in one script that fits in 10 minutes on one GPU machine.
Every GPU of the machine is a rank (nccl). Like run.py, it interleaves the two sides round by round.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import workload  # noqa: E402
from run import PYTHON, Figure, Variant, machine, run_rounds, table  # noqa: E402

STEPS = 60


BIG_SHAPE = {"dim": 2048, "depth": 16, "heads": 16, "seq_len": 1024, "batch_per_gpu": 8, "num_chars": 4_000_000}


def hydraddp_command(nproc: int, wrap: str, shape: dict, compile_: bool = False):
    def command(run_dir: Path) -> list[str]:
        return [PYTHON, "-m", "hydraddp", f"hydra.run.dir={run_dir}", "backend=nccl", f"wrap={wrap}", "precision=bf16",
                "model=gpt", "data=text", f"model.dim={shape['dim']}", f"model.depth={shape['depth']}",
                f"model.heads={shape['heads']}", f"data.seq_len={shape['seq_len']}",
                f"data.dataset.num_chars={shape['num_chars']}", f"data.batch_size={shape['batch_per_gpu'] * nproc}",
                f"launcher.nproc_per_node={nproc}", f"trainer.max_steps={STEPS}", "trainer.eval_every=0",
                f"trainer.compile={str(compile_).lower()}", "tracking.enabled=false"]
    return command


def compile_variants(nproc: int) -> list[Variant]:
    """hydraddp alone, compile off and on: the 1024x12 GPT under ddp, and the 808M GPT."""
    found = []
    for label, shape in (("gpt", workload.GPT_SHAPE), ("gpt808m", BIG_SHAPE)):
        for compile_ in (False, True):
            name = f"hydraddp-ddp-{label}-{'compiled' if compile_ else 'eager'}"
            found.append(Variant(name, f"hydraddp wrap=ddp bf16, {label}, compile={compile_}",
                                 hydraddp_command(nproc, "ddp", shape, compile_), lambda run_dir: run_dir / "result.json"))
    return found


def variants(nproc: int, wrap: str) -> list[Variant]:
    shape = workload.GPT_SHAPE
    hydraddp = hydraddp_command(nproc, wrap, shape)

    def plain(run_dir: Path) -> list[str]:
        # torchrun as a module: on an image whose torch came with the system Python, no torchrun may sit beside it
        return [PYTHON, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", str(HERE / "plain_gpt.py"),
                "--wrap", wrap, "--steps", str(STEPS), "--out", str(run_dir / "result.json")]

    return [Variant(f"hydraddp-{wrap}", f"hydraddp wrap={wrap} precision=bf16, GPT", hydraddp,
                    lambda run_dir: run_dir / "result.json"),
            Variant(f"plain-{wrap}", f"plain torchrun script, {wrap}, bf16, GPT", plain,
                    lambda run_dir: run_dir / "result.json")]


def commit() -> str:
    """The commit measured (RESULTS-gpu.md names it), "+ changes" when the tree differs from it."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=HERE.parent, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + (" + changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def flops_per_token(gpt_class, shape: dict) -> float:
    import torch

    with torch.device("meta"):
        return gpt_class(128, shape["seq_len"], shape["dim"], shape["depth"], shape["heads"]).flops_per_token()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, default=HERE / "results-gpu.json")
    parser.add_argument("--markdown", type=Path, default=HERE / "RESULTS-gpu.md")
    args = parser.parse_args()
    import torch

    from hydraddp.train.metrics import peak_flops

    if not torch.cuda.is_available():
        sys.exit("gpu_bench.py: no CUDA device; run it on a GPU machine (tests/gpu/run.sh does)")
    nproc, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    peak = peak_flops(torch.device("cuda", 0), torch.bfloat16)
    began = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="hydraddp-gpu-bench-"))
    results = {}
    for wrap in ("ddp", "fsdp2"):
        print(f"{wrap}: 2 variants x {args.rounds} rounds", flush=True)
        results.update(run_rounds(variants(nproc, wrap), args.rounds, work, lambda line: print(line, flush=True)))
    print("compile off and on, and the 808M GPT: 4 variants x 1 round", flush=True)
    compiled = run_rounds(compile_variants(nproc), 1, work, lambda line: print(line, flush=True))
    text = report(results, compiled, peak, nproc, f"Commit {commit()}; {name} x {nproc}; "
                                                    f"{time.perf_counter() - began:.0f} s")
    print("\n" + text)
    args.markdown.write_text(f"# GPU benchmark\n\n{text}\n")
    args.json.write_text(json.dumps({"machine": {**machine(), "gpu": name, "gpus": nproc}, "text": text,
                                     "variants": {k: [m.__dict__ for m in v] for k, v in {**results, **compiled}.items()}},
                                    indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


def report(results: dict, compiled: dict, peak: float | None, nproc: int, heading: str) -> str:
    """The ratios (hydraddp / plain, compiled / eager) and each variant's throughput, MFU and peak memory."""
    from hydraddp.models.gpt import GPT

    steady = lambda m: m.steady_samples_per_s  # noqa: E731
    figs = [Figure(f"steady_{wrap}", f"samples/s (= tokens/s), {wrap} bf16: hydraddp / plain", ">= 0.99",
                   [steady(a) / steady(b) for a, b in zip(results[f"hydraddp-{wrap}"], results[f"plain-{wrap}"])])
            for wrap in ("ddp", "fsdp2")]
    figs += [Figure(f"compile_{label}", f"samples/s, ddp bf16 {label}: compiled / eager", "> 1",
                    [steady(a) / steady(b) for a, b in zip(compiled[f"hydraddp-ddp-{label}-compiled"],
                                                           compiled[f"hydraddp-ddp-{label}-eager"])])
             for label in ("gpt", "gpt808m")]
    lines = [heading, "", table(figs), "",
             "| variant | samples/s | tokens/s | MFU | peak memory per GPU (GiB) |", "|---|---|---|---|---|"]
    for variant, ms in {**results, **compiled}.items():
        shape = BIG_SHAPE if "808m" in variant else workload.GPT_SHAPE
        samples = statistics.median(steady(m) for m in ms)
        tokens = samples * shape["seq_len"]
        mfu = f"{flops_per_token(GPT, shape) * tokens / (peak * nproc):.1%}" if peak else "-"
        lines.append(f"| {variant} | {samples:,.1f} | {tokens:,.0f} | {mfu} | "
                     f"{max(ms[-1].peak_memory_bytes) / 2**30:.1f} |")
    small = workload.GPT_SHAPE
    lines += ["", f"GPT {small['dim']}x{small['depth']}, seq {small['seq_len']}, {small['batch_per_gpu']} sequences per "
              f"GPU; 808M: {BIG_SHAPE['dim']}x{BIG_SHAPE['depth']}, seq {BIG_SHAPE['seq_len']}, "
              f"{BIG_SHAPE['batch_per_gpu']} per GPU. Written by `bash tests/gpu/run.sh`."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
