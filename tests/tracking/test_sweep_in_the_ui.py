"""A 2x2 sweep as a person compares it in MLflow's UI, against the suite's real `mlflow server`: what the sweep
prints, what it leaves in MLflow for the UI (the experiment's kind, a saved view, the parent's comparison), and what
headless Chromium then shows at the printed links. The screenshots are the README's pictures of the UI
(``HYDRADDP_SCREENSHOTS_DIR=docs/ui``). A single launch into a local SQLite store prints the `mlflow ui` command and
its run's page, checked the same way."""

import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from hydraddp.distributed.env import free_port
from hydraddp.tracking import names, ui, view
from hydraddp.tracking.comparison import TAG_BEST_LOSS_RUN, TAG_BEST_THROUGHPUT_RUN
from tests.helpers.browser import chromium, new_page, screenshot
from tests.helpers.spawn import child_env, run_cli
from tests.tracking.test_mlflow import QUICK, runs_of, tracked

pytestmark = pytest.mark.slow  # launches for real: see docs/development/tests.md

CHILDREN = {"ddp-fp32": ("ddp", "fp32"), "ddp-bf16": ("ddp", "bf16"), "fsdp2-fp32": ("fsdp2", "fp32"),
            "fsdp2-bf16": ("fsdp2", "bf16")}
LINK = re.compile(r"^  (?P<what>[\w' ]+): (?P<url>http\S+)$", re.M)
CARD = '[data-testid="experiment-view-compare-runs-card"]'
MiB = 2**20


@pytest.fixture(scope="module")
def sweep(mlflow_server, tmp_path_factory):
    experiment = f"ui-{uuid.uuid4().hex[:6]}"
    done = run_cli("-m", "wrap=ddp,fsdp2", "precision=fp32,bf16", *QUICK, "trainer.eval_every=6",
                   *tracked(mlflow_server, experiment), cwd=tmp_path_factory.mktemp("sweep"), timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = runs_of(mlflow_server, experiment)
    parent = next(r for r in runs if names.TAG_SWEEP in r.data.tags)
    children = {r.info.run_name: r for r in runs if names.TAG_SWEEP not in r.data.tags}
    links = {m["what"]: m["url"] for m in LINK.finditer(done.stdout)}
    client = mlflow_server.client()
    return SimpleNamespace(experiment=client.get_experiment_by_name(experiment), parent=parent, children=children,
                           links=links, stdout=done.stdout)


def test_the_experiment_opens_in_the_training_mode(sweep):
    assert sweep.experiment.tags[ui.EXPERIMENT_KIND_TAG] == ui.TRAINING_KIND


def test_the_children_are_named_by_what_the_sweep_varies(sweep):
    assert sorted(sweep.children) == sorted(CHILDREN)
    for name, (wrap, precision) in CHILDREN.items():
        tags = sweep.children[name].data.tags
        assert (tags[names.TAG_WRAP], tags[names.TAG_PRECISION]) == (wrap, precision)
        assert tags[names.TAG_SWEEP_ID] == tags[names.TAG_PARENT] == sweep.parent.info.run_id


def test_the_sweep_prints_its_runs_its_charts_and_its_run_before_mlflows_own_lines(sweep):
    experiment, parent = sweep.experiment.experiment_id, sweep.parent.info.run_id
    key = view.view_key(parent)
    base = f"{sweep.links['the runs'].split('/#/')[0]}/#/experiments/{experiment}"
    assert sweep.links == {
        "the runs": f"{base}/runs?viewStateShareKey={key}&{ui.TRAINING_MODE}",
        "their charts": f"{base}/runs?viewStateShareKey={key}&compareRunsMode=CHART&{ui.TRAINING_MODE}",
        "the sweep's run": f"{base}/runs/{parent}?{ui.TRAINING_MODE}"}
    ours = sweep.stdout.index(sweep.links["the runs"])
    mlflows = sweep.stdout.index(f"View run {sweep.parent.info.run_name} at")
    assert ours < mlflows


def test_the_saved_view_shows_the_sweeps_runs_flat_with_their_columns_and_charts(sweep):
    tag = view.SHARE_TAG_PREFIX + view.view_key(sweep.parent.info.run_id)
    state = view.read_state(sweep.experiment.tags[tag])
    assert state["searchFilter"] == f"tags.`{names.TAG_SWEEP_ID}` = '{sweep.parent.info.run_id}'"
    assert state["orderByKey"] != "attributes.start_time"  # the UI nests (and folds) children under that sort only
    assert {"tags.`hydraddp.wrap`", "tags.`hydraddp.precision`", "tags.`hydraddp.mesh`",
            "metrics.`perf/samples_per_s`", "metrics.`memory/peak_mib/max`", "metrics.`train/loss`",
            "metrics.`eval/loss`", "metrics.`perf/mfu`"} <= set(state["selectedColumns"])
    shown = {(c["type"], c["metricKey"]) for c in state["compareRunCharts"] if not c["deleted"]}
    assert {("BAR", "perf/samples_per_s"), ("BAR", "memory/peak_mib/max"), ("LINE", "train/loss")} <= shown
    # Every other metric has a deleted card, or the UI would add a chart of each.
    hidden = {c["metricKey"] for c in state["compareRunCharts"] if c["deleted"]}
    for run in sweep.children.values():
        assert set(run.data.metrics) <= hidden | {key for _, key in shown}


def test_the_parent_carries_the_comparison_as_metrics_and_params(sweep):
    metrics, params = sweep.parent.data.metrics, sweep.parent.data.params
    for name, child in sweep.children.items():
        mine = child.data.metrics
        assert metrics[f"sweep/{name}/samples_per_s"] == mine[names.SAMPLES_PER_S]
        assert metrics[f"sweep/{name}/final_loss"] == mine[names.LOSS]
        assert metrics[f"sweep/{name}/eval_loss"] == mine[names.EVAL_LOSS]
        for rank in (0, 1):
            assert metrics[f"sweep/{name}/peak_memory_mib/rank{rank}"] == \
                pytest.approx(mine[f"memory/peak_bytes/rank{rank}"] / MiB)
            state = sum(mine[f"sharding/{part}/rank{rank}"] for part in ("param_bytes", "grad_bytes",
                                                                          "optim_state_bytes"))
            assert metrics[f"sweep/{name}/state_mib/rank{rank}"] == pytest.approx(state / MiB)
    by_id = {c.info.run_id: c for c in sweep.children.values()}
    for tag, param in ((TAG_BEST_LOSS_RUN, "sweep/best_loss_run"), (TAG_BEST_THROUGHPUT_RUN,
                                                                     "sweep/best_throughput_run")):
        best = by_id[sweep.parent.data.tags[tag]]
        assert params[param] == best.info.run_name
        assert params[f"{param}_url"].endswith(f"/runs/{best.info.run_id}?{ui.TRAINING_MODE}")


def test_memory_is_also_logged_in_mib(sweep):
    for child in sweep.children.values():
        mine = child.data.metrics
        assert mine["memory/peak_mib/max"] == pytest.approx(mine["memory/peak_bytes/max"] / MiB)
        assert mine["sharding/param_mib/rank0"] == pytest.approx(mine["sharding/param_bytes/rank0"] / MiB)


def _row_cells(page, column: str) -> dict[str, str]:
    """Run name -> the text of its cell in ``column`` (AG Grid keeps the pinned names and the body apart)."""
    names_by_row = dict(page.eval_on_selector_all(
        ".ag-pinned-left-cols-container .ag-row",
        "rows => rows.map(r => [r.getAttribute('row-index'), r.querySelector('a') ? r.querySelector('a').innerText "
        ": ''])"))
    cells = page.eval_on_selector_all(f'.ag-cell[col-id="{column}"]',
                                      "cells => cells.map(c => [c.closest('.ag-row').getAttribute('row-index'), "
                                      "c.innerText])")
    return {names_by_row[index]: text for index, text in cells if index in names_by_row}


def test_in_a_browser_the_runs_link_lists_the_sweep_with_wrap_and_precision(sweep, tmp_path):
    with chromium() as browser:
        page = new_page(browser)
        page.goto(sweep.links["the runs"])
        page.wait_for_selector("text=You're viewing a shared view")
        page.wait_for_selector('.ag-header-cell[col-id="tags.`hydraddp.precision`"]', state="attached")
        for name in CHILDREN:
            page.wait_for_selector(f".ag-pinned-left-cols-container >> text={name}")
        assert "/runs?" in page.url and "/overview" not in page.url  # the runs list, not the GenAI overview
        assert page.get_by_text("Evaluation runs").count() == 0 and page.get_by_role("link", name="Runs").count()
        wraps, precisions = _row_cells(page, "tags.`hydraddp.wrap`"), _row_cells(page, "tags.`hydraddp.precision`")
        assert {name: (wraps[name], precisions[name]) for name in CHILDREN} == CHILDREN
        assert sweep.parent.info.run_name in page.inner_text(".ag-pinned-left-cols-container")
        screenshot(page, tmp_path / "sweep-runs.png")


def test_in_a_browser_the_charts_link_draws_throughput_memory_and_loss_of_all_four(sweep, tmp_path):
    with chromium() as browser:
        page = new_page(browser)
        page.goto(sweep.links["their charts"])
        page.wait_for_selector(f"{CARD} .js-plotly-plot")
        wanted = ["perf/samples_per_s", "memory/peak_mib/max", "train/loss"]
        for title in wanted:
            page.wait_for_selector(f"{CARD}:has-text('{title}') .js-plotly-plot")
        cards = dict(page.eval_on_selector_all(CARD, "cards => cards.map(c => [c.innerText.split('\\n')[0], "
                                                     "c.innerText])"))
        assert list(cards)[:3] == wanted  # the view's own charts, first and in its order
        for title in wanted:  # every child is in each chart's legend
            assert all(name in cards[title] for name in CHILDREN), (title, cards[title])
        throughput = cards["perf/samples_per_s"]
        for child in sweep.children.values():  # the bars carry the children's own values
            assert f"{child.data.metrics[names.SAMPLES_PER_S]:.2f}" in throughput
        screenshot(page, tmp_path / "sweep-charts.png")


def test_in_a_browser_the_parent_shows_its_comparison_metrics_and_sharding_per_rank(sweep, tmp_path):
    with chromium() as browser:
        page = new_page(browser)
        page.goto(sweep.links["the sweep's run"])
        page.wait_for_selector("text=sweep/ddp-fp32/samples_per_s")
        text = page.inner_text("body")
        for name in CHILDREN:
            for metric in ("samples_per_s", "peak_memory_mib/rank0", "state_mib/rank0", "state_mib/rank1"):
                assert f"sweep/{name}/{metric}" in text
        assert "Evaluations" not in text  # the GenAI breadcrumb
        screenshot(page, tmp_path / "sweep-parent.png")


def _serve(command: list[str], port: int, root: Path) -> subprocess.Popen:
    """The printed `mlflow ui` command, on a free port: 5000 may be taken on a shared machine."""
    log = (root / "ui.log").open("w")
    proc = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(port)], cwd=root, stdout=log,
                            stderr=log, start_new_session=True,
                            env=child_env(uuid.uuid4().hex, {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            assert proc.poll() is None, (root / "ui.log").read_text()[-3000:]
            time.sleep(0.3)
    raise AssertionError("mlflow ui did not start")


def test_a_launch_into_a_local_store_prints_the_ui_command_and_its_runs_page(tmp_path):
    done = run_cli(*QUICK, "tracking.model.enabled=false", cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    store = f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    command_line = next(line for line in done.stdout.splitlines() if " -m mlflow ui " in line)
    command = shlex.split(command_line.split("#", 1)[0])
    assert command == [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", store]
    run_id = (next(tmp_path.glob("outputs/*/*/mlflow_run_id"))).read_text().strip()
    link = next(m["url"] for m in LINK.finditer(done.stdout) if m["what"] == "the run")
    assert re.fullmatch(rf"{re.escape(ui.LOCAL_UI)}/#/experiments/\d+/runs/{run_id}\?{ui.TRAINING_MODE}", link)
    assert done.stdout.index(command_line) < done.stdout.index("hydraddp: done.")
    port = free_port()
    server = _serve(command, port, tmp_path)
    try:
        with chromium() as browser:
            page = new_page(browser)
            page.goto(link.replace(ui.LOCAL_UI, f"http://127.0.0.1:{port}"))
            page.wait_for_selector("text=Metrics (")
            assert f"/runs/{run_id}" in page.url
            text = page.inner_text("body")
            assert "train/loss" in text and "Evaluations" not in text
            assert page.get_by_role("link", name="Runs").count()  # the training mode's navigation
            screenshot(page, tmp_path / "launch-run.png")
    finally:
        os.killpg(server.pid, 15)
        server.wait(30)
