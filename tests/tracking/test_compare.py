"""A sweep's parent run and ``python -m hydraddp.compare`` against a real `mlflow server`: the table, the plots and
the best-run tags a person reads."""

import json
import re
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from hydraddp.tracking import names
from hydraddp.tracking.comparison import (TAG_BEST_LOSS_RUN, TAG_BEST_THROUGHPUT_RUN, Compared, best_runs, gather,
                                       loss_figure, memory_figure, row, run_label)
from hydraddp.tracking.per_rank import PerRankTable
from tests.helpers.spawn import run_cli, run_process
from tests.tracking.test_mlflow import QUICK, runs_of, tracked

pytestmark = pytest.mark.slow  # launches for real: see docs/development/tests.md

REPO = Path(__file__).resolve().parents[2]
HEADER = ["run", "id", "wrap", "precision", "world", "samples/s", "max", "rank", "p+g+o", "MiB", "peak", "mem", "MiB",
          "planned", "peak", "MiB", "tensor", "peak", "MiB", "plan", "error", "final", "loss", "status", "run"]
FIELDS = 12  # whitespace-separated fields of a row before the run's name, which may hold spaces
STATE = ("param_bytes", "grad_bytes", "optim_state_bytes")


@pytest.fixture(scope="module")
def sweep(mlflow_server, tmp_path_factory):
    """One 2-job sweep (experiment=quick, so the overrides hold Hydra's ``experiment@_global_``)."""
    experiment = f"compare-{uuid.uuid4().hex[:6]}"
    cwd = tmp_path_factory.mktemp("sweep")
    done = run_cli("-m", "experiment=quick", "wrap=ddp,fsdp2", *QUICK, *tracked(mlflow_server, experiment), cwd=cwd,
                   timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = runs_of(mlflow_server, experiment)
    parents = [r for r in runs if names.TAG_SWEEP in r.data.tags]
    children = {r.info.run_id: r for r in runs if names.TAG_SWEEP not in r.data.tags}
    assert len(parents) == 1 and len(children) == 2
    return SimpleNamespace(experiment=experiment, parent=parents[0], children=children)


def compare_cli(target, server, cwd, *out):
    done = run_process([sys.executable, "-m", "hydraddp.compare", target, "--uri", server.uri, *out], cwd=cwd,
                       timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_sweep_is_one_parent_with_a_finished_child_per_job(sweep):
    parent = sweep.parent
    assert parent.info.status == "FINISHED" and "wrap=ddp,fsdp2" in parent.data.tags[names.TAG_SWEEP]
    assert all(c.data.tags[names.TAG_PARENT] == parent.info.run_id and c.info.status == "FINISHED"
               for c in sweep.children.values())
    assert sorted(c.data.tags[names.TAG_WRAP] for c in sweep.children.values()) == ["ddp", "fsdp2"]
    # What the user typed, not how Hydra assembles it.
    assert "experiment=quick" in parent.data.tags[names.TAG_SWEEP]
    assert "@_global_" not in parent.data.tags[names.TAG_SWEEP] + parent.info.run_name
    # Named by what it sweeps: the server's URI and the other overrides stay out of the name.
    assert parent.info.run_name == "sweep experiment=quick wrap=ddp,fsdp2"


def test_the_parent_holds_the_plots_and_the_comparison_table_in_mib(mlflow_server, sweep, tmp_path):
    client = mlflow_server.client()
    artifacts = {a.path for a in client.list_artifacts(sweep.parent.info.run_id)}
    assert {"loss_curves.png", "memory_per_rank.png", "comparison.json", "comparison.txt"} <= artifacts
    table = json.loads(Path(client.download_artifacts(sweep.parent.info.run_id, "comparison.json", tmp_path))
                       .read_text())
    assert table["columns"][0] == "run id" and table["columns"][-1] == "run"
    rows = [dict(zip(table["columns"], values)) for values in table["data"]]
    assert {r["run id"] for r in rows} == set(sweep.children)
    for r in rows:
        metrics = sweep.children[r["run id"]].data.metrics
        per_rank = [sum(metrics[f"sharding/{part}/rank{rank}"] for part in STATE) for rank in (0, 1)]
        assert r["max rank p+g+o MiB"] == pytest.approx(max(per_rank) / 2**20)  # MiB: 2**20 bytes, not 1e6
        assert r["tensor peak MiB"] == pytest.approx(metrics["memory/peak_tensor_bytes/rank0"] / 2**20)
        assert r["run"] and "@_global_" not in r["run"]
    text = Path(client.download_artifacts(sweep.parent.info.run_id, "comparison.txt", tmp_path)).read_text()
    assert text.split("\n")[0].split() == HEADER


def test_the_parent_names_the_child_with_the_lowest_loss_and_the_one_with_the_most_throughput(sweep):
    children = [c.data.metrics for c in sweep.children.values()]
    tags = sweep.parent.data.tags
    best_loss, fastest = sweep.children[tags[TAG_BEST_LOSS_RUN]], sweep.children[tags[TAG_BEST_THROUGHPUT_RUN]]
    # Equal losses (ddp and fsdp2 in fp32) may name either: the named one has the lowest value.
    assert best_loss.data.metrics[names.LOSS] == min(m[names.LOSS] for m in children)
    assert fastest.data.metrics[names.SAMPLES_PER_S] == max(m[names.SAMPLES_PER_S] for m in children)


def test_compare_prints_the_table_and_writes_the_plots(mlflow_server, sweep, tmp_path):
    stdout = compare_cli(sweep.experiment, mlflow_server, tmp_path, "--out", str(tmp_path / "plots"))
    header, *lines = stdout.splitlines()
    assert header.split() == HEADER
    rows = [line.split(maxsplit=FIELDS) for line in lines[:2]]
    assert sorted(r[0] for r in rows) == sorted(run_id[:8] for run_id in sweep.children)
    assert sorted(r[1] for r in rows) == ["ddp", "fsdp2"]
    for r in rows:
        planned, measured, error = r[7:10]  # planned against measured, and how far off: within 10% here
        assert float(planned) > 0 and float(measured) > 0 and abs(float(error.rstrip("%"))) <= 10, r
        name = sweep.children[next(i for i in sweep.children if i.startswith(r[0]))].info.run_name
        assert r[FIELDS] == name.replace("@_global_", "") and "@_global_" not in r[FIELDS]
    assert re.search(r"^lowest final loss: .+ \([0-9a-f]{8}\)$", stdout, re.M)
    for png in ("loss_curves.png", "memory_per_rank.png"):
        assert (tmp_path / "plots" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_by_default_the_plots_go_under_outputs_which_git_ignores(mlflow_server, sweep, tmp_path):
    target = sweep.parent.info.run_id
    stdout = compare_cli(target, mlflow_server, tmp_path)
    written = [Path(line.removeprefix("wrote ")) for line in stdout.splitlines() if line.startswith("wrote ")]
    assert written == [Path("outputs/compare") / target / png for png in ("loss_curves.png", "memory_per_rank.png")]
    assert all((tmp_path / path).is_file() for path in written)
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: nothing to check the ignore rules against")
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *map(str, written)], cwd=REPO,
                             capture_output=True, text=True)
    assert ignored.stdout.split() == [str(p) for p in written]


def test_labels_name_the_run_and_its_short_id_without_hydra_internals():
    run_id = "3f2a91c0d4e5f60718293a4b5c6d7e8f"
    assert run_label("fsdp2-bf16-w2-3f2a", run_id) == "fsdp2-bf16-w2-3f2a (3f2a91c0)"
    assert run_label("experiment@_global_=quick wrap=ddp", run_id) == "experiment=quick wrap=ddp (3f2a91c0)"
    assert run_label("", run_id, fallback="ddp/fp32") == "ddp/fp32 (3f2a91c0)"
    long = run_label("x" * 200, run_id)
    assert long.endswith("… (3f2a91c0)") and len(long) < 60


def runs_with_losses(*histories):
    """Runs as the comparison reads them, each with 2 ranks of 1, 1 and 2 MiB (params, grads, state)."""
    state = {f"sharding/{part}": {r: mib * 2**20 for r in range(2)} for part, mib in zip(STATE, (1, 1, 2))}
    return [Compared(f"{i:x}" * 32, f"ddp-fp32-w2-{i}", "FINISHED", {}, {}, {}, state, losses)
            for i, losses in enumerate(histories, start=10)]


def test_identical_loss_curves_stay_visible_and_are_said_to_be(tmp_path):
    same = [(4, 2.0), (8, 1.0), (12, 0.5)]
    runs = runs_with_losses(same, list(same), [(s, v + 0.4) for s, v in same])
    fig = loss_figure(runs)
    fig.savefig(tmp_path / "loss_curves.png")
    lines = fig.axes[0].get_lines()
    assert len({(line.get_marker(), line.get_linestyle(), line.get_color()) for line in lines}) == 3
    assert all(line.get_markerfacecolor() == "none" for line in lines)  # hollow: the one below shows through
    widths = [line.get_linewidth() for line in lines]
    assert widths == sorted(set(widths), reverse=True)  # each one thinner: the earlier shows around the later
    assert [text.get_text() for text in fig.legends[0].get_texts()] == [
        "ddp-fp32-w2-10 (aaaaaaaa)", "ddp-fp32-w2-11 (bbbbbbbb) - identical to aaaaaaaa", "ddp-fp32-w2-12 (cccccccc)"]


def test_failed_runs_are_never_named_best():
    finished, failed = runs_with_losses([(4, 1.0)], [(4, 0.1)])
    finished.metrics, failed.metrics = {names.LOSS: 1.0, names.SAMPLES_PER_S: 10.0}, {names.LOSS: 0.1,
                                                                                      names.SAMPLES_PER_S: 99.0}
    failed.status = "FAILED"
    assert best_runs([row(finished), row(failed)]) == {TAG_BEST_LOSS_RUN: finished.run_id,
                                                       TAG_BEST_THROUGHPUT_RUN: finished.run_id}
    assert best_runs([row(failed)]) == {}


def test_above_the_per_rank_key_limit_the_values_come_from_the_table_and_512_ranks_plot_as_three_bars(
        mlflow_server, tmp_path):
    client = mlflow_server.client()
    experiment_id = client.create_experiment(f"wide-{uuid.uuid4().hex[:6]}")
    run_id = client.create_run(experiment_id, tags={names.TAG_WORLD_SIZE: "512"}).info.run_id
    table = PerRankTable(active=True)  # what the tracker logs at this size: rank r holds (r % 5 + 1) MiB of each part
    for rank in range(512):
        for part in STATE:
            assert table.takes({"metric": f"sharding/{part}/rank{rank}", "step": 1, "value": (rank % 5 + 1) * 2**20})
    client.log_dict(run_id, table.to_json(), "sharding_per_rank.json")
    compared = gather(client, client.get_run(run_id))
    assert sorted(compared.per_rank["sharding/param_bytes"]) == list(range(512))
    assert row(compared)["max rank p+g+o MiB"] == pytest.approx(3 * 5)
    fig = memory_figure([compared])
    fig.savefig(tmp_path / "memory_per_rank.png")
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["largest: rank 4", "mean of 512 ranks",
                                                                     "smallest: rank 0"]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["parameters", "gradients", "optimizer state"]
