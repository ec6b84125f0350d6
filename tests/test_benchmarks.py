"""The benchmark harness runs (a tiny configuration, one round). Speed is never asserted here: these
machines are shared and noisy; benchmarks/run.py measures it side by side (benchmarks/RESULTS.md)."""

import json
import subprocess
import sys

import pytest

from benchmarks.run import BEGIN, END, main, staleness
from tests.helpers.spawn import REPO, run_process

FIGURES = {"steady_ddp", "steady_fsdp2", "steady_ignite", "steady_fabric", "steady_hf_ddp", "steady_hf_fsdp2",
           "default_bucket_view", "startup_mlflow", "startup_fresh_db", "startup_off", "startup_ignite",
           "startup_fabric", "scaling_hydraddp", "scaling_plain", "scaling_hydraddp_ceiling", "scaling_plain_ceiling",
           "fsdp2_autowrap", "shard_fsdp2", "shard_fsdp", "peak_rss_100m", "logging_cost", "import_cost",
           "import_core"}


@pytest.mark.slow
@pytest.mark.timeout(900)  # about 20 launches one after another: 270 s here at idle, more beside other tests
def test_the_harness_measures_every_figure_and_the_peers_train_the_same_model(tmp_path):
    results, markdown = tmp_path / "results.json", tmp_path / "RESULTS.md"
    markdown.write_text(f"# Results\n\nwritten by hand\n\n{BEGIN}\nold table\n{END}\n\nanalysis by hand\n")
    done = run_process([sys.executable, "benchmarks/run.py", "--smoke", "--json", str(results), "--markdown",
                        str(markdown)], cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(results.read_text())
    figures = {f["key"]: f for f in report["figures"]}
    assert set(figures) == FIGURES
    for figure in figures.values():
        assert figure["n"] >= 1 and all(r > 0 for r in figure["ratios"])
        assert figure["min"] <= figure["median"] <= figure["max"]
        assert figure["verdict"] in ("met", "MISSED", "reported")
    # Fully sharded state is half of DDP's on 2 ranks: measured from the WrapReports, whatever the speed.
    assert figures["shard_fsdp2"]["median"] == pytest.approx(0.5, abs=0.01)
    # The peers are the same training: same model, data, seed and optimizer give the same final loss.
    variants = report["variants"]
    hydraddp_loss = variants["hydraddp-ddp"][0]["final_loss"]
    for peer in ("plain-ddp", "ignite-ddp", "fabric-ddp", "hydraddp-ddp-no-bucket-view"):
        assert variants[peer][0]["final_loss"] == pytest.approx(hydraddp_loss, rel=1e-4), peer
    for ours, plain in (("hydraddp-fsdp2", "plain-fsdp2-root"), ("hydraddp-1proc", "plain-1proc"),
                        ("hydraddp-hf-ddp", "plain-hf-ddp"), ("hydraddp-hf-fsdp2", "plain-hf-fsdp2")):
        # The same work on both sides: the one-process baselines too (they once read different sample orders).
        assert variants[plain][0]["final_loss"] == pytest.approx(variants[ours][0]["final_loss"], rel=1e-4), ours
    # RESULTS.md: the generated block is replaced, the hand-written text around it kept.
    text = markdown.read_text()
    assert "written by hand" in text and "analysis by hand" in text and "old table" not in text
    assert "| figure | target | min | median | max |" in text


def test_check_says_whether_results_md_describes_the_code(tmp_path):
    """``run.py --check`` replaces a test that failed on every change under hydraddp/ until the 25-minute benchmark
    ran again: staleness is a command's answer, not a gate on every commit."""
    git = lambda *args: subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True)  # noqa: E731
    git("init", "-q")
    (tmp_path / "hydraddp").mkdir()
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "hydraddp" / "loop.py").write_text("step = 1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "measured")
    commit = git("rev-parse", "--short", "HEAD").stdout.strip()
    markdown = tmp_path / "benchmarks" / "RESULTS.md"
    markdown.write_text(f"# Results\n\nMeasured today on a CPU, hydraddp {commit}; CPU, gloo, 2 ranks.\n")
    assert staleness(markdown, tmp_path) == (commit, [])  # the results themselves changing keeps them current
    (tmp_path / "hydraddp" / "loop.py").write_text("step = 2\n")
    assert staleness(markdown, tmp_path) == (commit, ["hydraddp/loop.py"])
    markdown.write_text("Measured today, hydraddp abc1234-dirty; CPU\n")
    assert staleness(markdown, tmp_path) == (None, [])


def test_the_check_command_answers_for_this_checkout(capsys):
    returncode = main(["--check"])  # in this process: --check measures nothing and starts nothing
    commit, changed = staleness()
    out = capsys.readouterr().out
    assert returncode == (0 if commit and not changed else 1), out
    assert ("is current" if returncode == 0 else "Run benchmarks/run.py") in out


def test_the_gpu_report_gives_each_ratio_and_each_variant_with_its_mfu():
    """``benchmarks/gpu_bench.py`` runs only on a GPU machine; its report is checked here on made-up measurements
    (it once imported a name the MFU table no longer had, and the GPU run failed only there)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_bench
    from benchmarks.run import Measurement

    def runs(samples_per_s: float) -> list:
        return [Measurement(1.0, 2.0, samples_per_s, [2**30], [0], 1.0)]

    results = {f"{side}-{wrap}": runs(100.0 if side == "plain" else 99.0)
               for wrap in ("ddp", "fsdp2") for side in ("hydraddp", "plain")}
    compiled = {name.name: runs(120.0 if "compiled" in name.name else 100.0) for name in gpu_bench.compile_variants(1)}
    text = gpu_bench.report(results, compiled, 989.4e12, 1, "Commit abc; NVIDIA H200 x 1")
    assert "| samples/s, ddp bf16 gpt808m: compiled / eager | > 1 | 1.200 |" in text
    assert "| samples/s (= tokens/s), fsdp2 bf16: hydraddp / plain | >= 0.99 | 0.990 |" in text
    from hydraddp.models.gpt import GPT

    tokens = 120.0 * gpu_bench.BIG_SHAPE["seq_len"]
    mfu = gpu_bench.flops_per_token(GPT, gpu_bench.BIG_SHAPE) * tokens / 989.4e12
    assert f"| hydraddp-ddp-gpt808m-compiled | 120.0 | {tokens:,.0f} | {mfu:.1%} | 1.0 |" in text
