"""The GPU benchmark: bf16 DDP and FSDP2 on hydraddp's GPT, hydraddp ÷ a plain torchrun script, and MFU.

    python benchmarks/gpu_bench.py [--rounds 2] [--json benchmarks/results-gpu.json]

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
from run import PYTHON, TORCHRUN, Figure, Variant, machine, measure, run_rounds, table  # noqa: E402

STEPS = 60


def variants(nproc: int, wrap: str) -> list[Variant]:
    shape = workload.GPT_SHAPE

    def hydraddp(run_dir: Path) -> list[str]:
        return [PYTHON, "-m", "hydraddp", f"hydra.run.dir={run_dir}", "backend=nccl", f"wrap={wrap}", "precision=bf16",
                "model=gpt", "data=text", f"model.dim={shape['dim']}", f"model.depth={shape['depth']}",
                f"model.heads={shape['heads']}", f"data.seq_len={shape['seq_len']}",
                f"data.dataset.num_chars={shape['num_chars']}", f"data.batch_size={shape['batch_per_gpu'] * nproc}",
                f"launcher.nproc_per_node={nproc}", f"trainer.max_steps={STEPS}", "trainer.eval_every=0",
                "tracking.enabled=false"]

    def plain(run_dir: Path) -> list[str]:
        return [TORCHRUN, f"--nproc_per_node={nproc}", str(HERE / "plain_gpt.py"), "--wrap", wrap,
                "--steps", str(STEPS), "--out", str(run_dir / "result.json")]

    return [Variant(f"hydraddp-{wrap}", f"hydraddp wrap={wrap} precision=bf16, GPT", hydraddp,
                    lambda run_dir: run_dir / "result.json"),
            Variant(f"plain-{wrap}", f"plain torchrun script, {wrap}, bf16, GPT", plain,
                    lambda run_dir: run_dir / "result.json")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, default=HERE / "results-gpu.json")
    args = parser.parse_args()
    import torch

    from hydraddp.models.gpt import GPT
    from hydraddp.train.metrics import PEAK_FLOPS

    if not torch.cuda.is_available():
        sys.exit("gpu_bench.py: no CUDA device; run it on a GPU machine (tests/gpu/run.sh does)")
    nproc, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    peak = next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)
    shape = workload.GPT_SHAPE
    with torch.device("meta"):
        flops_per_token = GPT(128, shape["seq_len"], shape["dim"], shape["depth"], shape["heads"]).flops_per_token()
    began = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="hydraddp-gpu-bench-"))
    results = {}
    for wrap in ("ddp", "fsdp2"):
        print(f"{wrap}: 2 variants x {args.rounds} rounds", flush=True)
        results.update(run_rounds(variants(nproc, wrap), args.rounds, work, lambda line: print(line, flush=True)))
    steady = lambda m: m.steady_samples_per_s  # noqa: E731
    figs = [Figure(f"steady_{wrap}", f"samples/s (= tokens/s), {wrap} bf16: hydraddp / plain", ">= 0.99",
                   [steady(a) / steady(b) for a, b in zip(results[f"hydraddp-{wrap}"], results[f"plain-{wrap}"])])
            for wrap in ("ddp", "fsdp2")]
    lines = [f"{name} x {nproc}; GPT {shape['dim']}x{shape['depth']}, seq {shape['seq_len']}, "
             f"{shape['batch_per_gpu']} sequences per GPU; {time.perf_counter() - began:.0f} s", "", table(figs), "",
             "| variant | samples/s | tokens/s | MFU | peak memory per GPU (GiB) |", "|---|---|---|---|---|"]
    for variant, ms in results.items():
        samples = statistics.median(steady(m) for m in ms)
        tokens = samples * shape["seq_len"]
        mfu = f"{flops_per_token * tokens / (peak * nproc):.1%}" if peak else "-"
        lines.append(f"| {variant} | {samples:,.1f} | {tokens:,.0f} | {mfu} | "
                     f"{max(ms[-1].peak_memory_bytes) / 2**30:.1f} |")
    text = "\n".join(lines)
    print("\n" + text)
    args.json.write_text(json.dumps({"machine": {**machine(), "gpu": name, "gpus": nproc}, "text": text,
                                     "variants": {k: [m.__dict__ for m in v] for k, v in results.items()}}, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
