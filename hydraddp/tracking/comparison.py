"""Compare the runs of an experiment or of a sweep: a table and two PNG plots.

    python -m hydraddp.compare EXPERIMENT_OR_PARENT_RUN [--uri URI] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from hydraddp.parallel.mesh import MeshShape
from hydraddp.tracking import names
from hydraddp.tracking.client import default_uri, mlflow_client
from hydraddp.tracking.per_rank import PER_RANK_KEY, STEP_SUFFIX, TABLE_FILE
from hydraddp.tracking.run import FINISHED

# On a sweep's parent run: the FINISHED child with the lowest final train/loss, and the one with the most samples/s.
TAG_BEST_LOSS_RUN, TAG_BEST_THROUGHPUT_RUN = "hydraddp.best_loss_run", "hydraddp.best_throughput_run"
LOSS_PLOT, MEMORY_PLOT = "loss_curves.png", "memory_per_rank.png"
TABLE_JSON, TABLE_TEXT = "comparison.json", "comparison.txt"  # on a sweep's parent run
# Next to Hydra's own outputs/DATE/TIME job directories: ignored with them, never among a project's sources.
DEFAULT_OUT = Path("outputs") / "compare"
MiB = 2**20
STATE_PARTS = (("param_bytes", "parameters"), ("grad_bytes", "gradients"), ("optim_state_bytes", "optimizer state"))
RANKS_SHOWN = 16  # above this, a run's bars are its largest rank, the mean and its smallest rank
MAX_NAME = 48  # characters of a run name in a label; the short id keeps labels apart
COLUMNS = ("run id", "wrap", "precision", "world", "samples/s", "max rank p+g+o MiB", "peak mem MiB",
           "planned peak MiB", "tensor peak MiB", "plan error", "final loss", "status", "run")
# Hydra's reserved packages in an override (`experiment=quick` is passed on as `experiment@_global_=quick`): how
# the config is assembled, not what the run is.
_HYDRA_PACKAGE = re.compile(r"@_(?:global|group|here)_(?!\w)")
_MARKERS, _LINESTYLES = "osD^vPX*", ("-", "--", "-.", ":")
log = logging.getLogger(__name__)


def readable(text: str) -> str:
    """``text`` without Hydra's package internals: ``experiment@_global_=quick`` -> ``experiment=quick``."""
    return _HYDRA_PACKAGE.sub("", text)


def run_label(run_name: str | None, run_id: str, fallback: str = "?") -> str:
    """A run's name and short id, e.g. ``fsdp2-bf16-w2-3f2a (3f2a91c0)``: names repeat across runs, ids do not."""
    name = readable(run_name or "") or fallback
    if len(name) > MAX_NAME:
        name = name[: MAX_NAME - 1] + "…"
    return f"{name} ({run_id[:8]})"


@dataclass
class Compared:
    """One run as the comparison reads it."""

    run_id: str
    name: str
    status: str
    tags: dict[str, str]
    metrics: dict[str, float]
    params: dict[str, str]
    per_rank: dict[str, dict[int, float]]  # metric base (sharding/param_bytes, ...) -> rank -> value
    losses: list[tuple[int, float]]  # (step, train/loss) in step order

    @property
    def label(self) -> str:
        return run_label(self.name, self.run_id,
                         f"{self.tags.get(names.TAG_WRAP, '?')}/{self.tags.get(names.TAG_PRECISION, '?')}")


def find_runs(client: Any, target: str) -> list[Any]:
    """A parent run's children (a sweep), or every run of the experiment named ``target`` but sweep parents."""
    from mlflow.exceptions import MlflowException

    try:
        parent = client.get_run(target)
    except MlflowException:
        parent = None
    if parent is not None:
        experiment_ids = [parent.info.experiment_id]
        query = f"tags.`{names.TAG_PARENT}` = '{target}'"
    else:
        experiment = client.get_experiment_by_name(target)
        if experiment is None:
            raise SystemExit(f"hydraddp.compare: {target!r} is neither a run id nor an experiment name")
        experiment_ids, query = [experiment.experiment_id], ""
    runs = client.search_runs(experiment_ids, query, order_by=["attributes.start_time ASC"], max_results=5000)
    return [r for r in runs if names.TAG_SWEEP not in r.data.tags]


def _per_rank_table(client: Any, run_id: str) -> dict[str, dict[int, float]]:
    """Above tracking.per_rank_table_above ranks, a run's per-rank values are the rows of its ``TABLE_FILE``
    artifact (log_table's split layout: ``{"columns": ["rank", base, ..., base@step, ...], "data": [...]}``)."""
    if TABLE_FILE not in {a.path for a in client.list_artifacts(run_id)}:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(client.download_artifacts(run_id, TABLE_FILE, tmp)).read_text()
    try:
        table = json.loads(text)
        rank = table["columns"].index("rank")
        return {column: {int(row[rank]): float(row[i]) for row in table["data"] if row[i] is not None}
                for i, column in enumerate(table["columns"]) if i != rank and not column.endswith(STEP_SUFFIX)}
    except (ValueError, KeyError, IndexError, TypeError) as exc:  # one unreadable table must not stop the rest
        log.warning("run %s: %s cannot be read (%s); its per-rank values are left out", run_id, TABLE_FILE, exc)
        return {}


def per_rank(client: Any, run: Any) -> dict[str, dict[int, float]]:
    """Every per-rank value of ``run``: from its ``base/rank{r}`` metrics, else from its per-rank table artifact."""
    found: dict[str, dict[int, float]] = {}
    for key, value in run.data.metrics.items():
        match = PER_RANK_KEY.fullmatch(key)
        if match:
            found.setdefault(match["base"], {})[int(match["rank"])] = value
    if "sharding/param_bytes" not in found:
        for base, values in _per_rank_table(client, run.info.run_id).items():
            found.setdefault(base, values)
    return found


def gather(client: Any, run: Any) -> Compared:
    history = sorted(client.get_metric_history(run.info.run_id, names.LOSS), key=lambda m: m.step)
    return Compared(run.info.run_id, run.info.run_name or "", run.info.status, dict(run.data.tags),
                    dict(run.data.metrics), dict(run.data.params), per_rank(client, run),
                    [(m.step, m.value) for m in history])


def _mib(value: float | None) -> float | None:
    return None if value is None else value / MiB


def rank_state(run: Compared) -> dict[int, list[float]]:
    """rank -> [parameter, gradient, optimizer-state] bytes on that rank."""
    parts = [run.per_rank.get(f"sharding/{part}", {}) for part, _ in STATE_PARTS]
    return {r: [part.get(r, 0.0) for part in parts] for r in sorted(set().union(*parts))}


def row(run: Compared) -> dict[str, Any]:
    """The table's columns for ``run``, sizes in MiB (2**20 bytes)."""
    metrics, state = run.metrics, rank_state(run)
    peaks = run.per_rank.get(names.PEAK_MEMORY, {})
    world = run.tags.get(names.TAG_WORLD_SIZE, "?")
    return {
        "run id": run.run_id,
        "wrap": run.tags.get(names.TAG_WRAP, "?"),
        "precision": run.tags.get(names.TAG_PRECISION, "?"),
        "world": int(world) if world.isdigit() else world,
        # dp_replicate x dp_shard x tp, from the hydraddp.mesh tag (fsdp2 and ddp); "-" for the other wraps
        "mesh": MeshShape.parse(run.tags[names.TAG_MESH]).label()
        if names.TAG_MESH in run.tags else None,
        "samples/s": metrics.get(names.SAMPLES_PER_S),
        "max rank p+g+o MiB": max(map(sum, state.values())) / MiB if state else None,
        "peak mem MiB": _mib(max(peaks.values()) if peaks else metrics.get(f"{names.PEAK_MEMORY}/max")),
        # The plan of rank 0 against what rank 0 measured over the second step (hydraddp/plan/).
        "planned peak MiB": _mib(int(run.params["plan/peak_bytes"])) if "plan/peak_bytes" in run.params else None,
        "tensor peak MiB": _mib(run.per_rank.get(names.PEAK_TENSOR, {}).get(0)),
        "plan error": f"{metrics['plan/error/peak_bytes']:+.1%}" if "plan/error/peak_bytes" in metrics else None,
        "final loss": metrics.get(names.LOSS),
        "status": run.status,
        "run": readable(run.name),
    }


def table(rows: list[dict[str, Any]]) -> str:
    """Fixed-width text: numbers right-aligned; the run id short; the run's name last, as it may be long."""
    def cell(column: str, value: Any) -> str:
        if column == "run id":
            return value[:8]
        if isinstance(value, float):
            return f"{value:.4f}" if abs(value) < 10 else f"{value:,.1f}"
        return "-" if value is None else str(value)

    lines = [list(COLUMNS), *([cell(c, r[c]) for c in COLUMNS] for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS) - 1)]
    return "\n".join("  ".join([*(v.rjust(w) for v, w in zip(line, widths)), line[-1]]) for line in lines)


def best_runs(rows: list[dict[str, Any]]) -> dict[str, str]:
    """Tag -> run id: the FINISHED run with the lowest final loss, and the one with the most samples/s."""
    best = {}
    for tag, column, pick in ((TAG_BEST_LOSS_RUN, "final loss", min), (TAG_BEST_THROUGHPUT_RUN, "samples/s", max)):
        candidates = [r for r in rows if r["status"] == FINISHED and isinstance(r[column], (int, float))
                      and math.isfinite(r[column])]
        if candidates:
            best[tag] = pick(candidates, key=lambda r: r[column])["run id"]
    return best


def _overlaps(runs: list[Compared]) -> dict[int, str]:
    """index -> a note for each run whose loss curve would hide under an earlier one's (same steps, and values
    within a pixel of a 450-pixel plot, or identical)."""
    values = [v for run in runs for _, v in run.losses]
    tolerance = (max(values) - min(values)) / 450 if values else 0.0
    notes = {}
    for i, run in enumerate(runs):
        for earlier in runs[:i]:
            if run.losses and [s for s, _ in run.losses] == [s for s, _ in earlier.losses]:
                if run.losses == earlier.losses:
                    notes[i] = f"identical to {earlier.run_id[:8]}"
                elif all(abs(a - b) <= tolerance for (_, a), (_, b) in zip(run.losses, earlier.losses)):
                    notes[i] = f"overlaps {earlier.run_id[:8]}"
                else:
                    continue
                break
    return notes


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def loss_figure(runs: list[Compared]) -> Any:
    """train/loss of every run. Curves that coincide stay visible: each run has its own colour, dash pattern and
    hollow marker shape, drawn thinner and smaller than the one before it (so the earlier shows around it), and
    the legend says which curves are the same."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    notes = _overlaps(runs)
    for i, run in enumerate(runs):
        label = run.label + (f" - {notes[i]}" if i in notes else "") + ("" if run.losses else " - no loss logged")
        ax.plot([s for s, _ in run.losses], [v for _, v in run.losses], label=label, color=f"C{i % 10}",
                marker=_MARKERS[i % len(_MARKERS)], markersize=11 - 2 * (i % 4), markerfacecolor="none",
                markeredgewidth=1.5, linestyle=_LINESTYLES[i % len(_LINESTYLES)], linewidth=3.2 - 0.7 * (i % 4),
                alpha=0.85)
    ax.set(xlabel="step", ylabel=names.LOSS, title="Training loss")
    ax.grid(alpha=0.3)
    fig.legend(loc="outside lower center", fontsize="small", frameon=False)
    return fig


def _bars(run: Compared) -> list[tuple[str, list[float]]]:
    """(label, MiB per state part) of each bar of ``run``: every rank, or the largest, mean and smallest rank."""
    state = {r: [v / MiB for v in parts] for r, parts in rank_state(run).items()}
    if len(state) <= RANKS_SHOWN:
        return [(f"rank {r}", parts) for r, parts in state.items()]
    largest, smallest = max(state, key=lambda r: sum(state[r])), min(state, key=lambda r: sum(state[r]))
    mean = [sum(parts[k] for parts in state.values()) / len(state) for k in range(len(STATE_PARTS))]
    return [(f"largest: rank {largest}", state[largest]), (f"mean of {len(state)} ranks", mean),
            (f"smallest: rank {smallest}", state[smallest])]


def memory_figure(runs: list[Compared]) -> Any:
    """What sharding did: each rank's parameter, gradient and optimizer-state MiB, stacked, one panel per run."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    bars = [_bars(run) for run in runs]
    heights = [max(len(b), 1) for b in bars]
    fig, axes = plt.subplots(len(runs), 1, sharex=True, squeeze=False, height_ratios=heights, layout="constrained",
                             figsize=(8, 1.6 + 0.32 * sum(heights) + 0.5 * len(runs)))
    for ax, run, rows in zip(axes[:, 0], runs, bars):
        ax.set_title(run.label, loc="left", fontsize="small")
        if not rows:
            ax.text(0.5, 0.5, "no sharding metrics logged (a run that ended before its first step?)", ha="center",
                    va="center", transform=ax.transAxes, fontsize="small")
            ax.set_yticks([])
            continue
        left = [0.0] * len(rows)
        for k in range(len(STATE_PARTS)):
            widths = [parts[k] for _, parts in rows]
            ax.barh(range(len(rows)), widths, left=left, height=0.7, color=f"C{k}")
            left = [a + b for a, b in zip(left, widths)]
        for y, total in enumerate(left):
            ax.text(total, y, f" {total:,.2f}" if total < 100 else f" {total:,.0f}", va="center", fontsize="x-small")
        ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize="small")
        ax.set_ylim(len(rows) - 0.5, -0.5)  # rank 0 on top
        ax.margins(x=0.12)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("MiB on the rank")
    fig.suptitle("Parameters, gradients and optimizer state per rank (what sharding divides)", fontsize="medium")
    fig.legend(handles=[Patch(color=f"C{k}", label=label) for k, (_, label) in enumerate(STATE_PARTS)],
               loc="outside lower center", ncol=len(STATE_PARTS), fontsize="small", frameon=False)
    return fig


def plots(runs: list[Compared], out_dir: Path) -> list[Path]:
    """``loss_curves.png`` and ``memory_per_rank.png`` in ``out_dir``."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for figure, name in ((loss_figure, LOSS_PLOT), (memory_figure, MEMORY_PLOT)):
        fig = figure(runs)
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        paths.append(out_dir / name)
    return paths


class Comparison(NamedTuple):
    rows: list[dict[str, Any]]  # COLUMNS of each run, sizes in MiB, the full run id
    text: str  # the table and which runs were best, as printed
    plots: list[Path]
    best: dict[str, str]  # TAG_BEST_* -> run id
    runs: list[Compared]  # in the rows' order


def _best_text(best: dict[str, str], runs: list[Compared]) -> str:
    labels = {run.run_id: run.label for run in runs}
    said = {TAG_BEST_LOSS_RUN: "lowest final loss", TAG_BEST_THROUGHPUT_RUN: "most samples/s"}
    return "\n".join(f"{said[tag]}: {labels[run_id]}" for tag, run_id in best.items())


def compare(target: str, uri: str, out_dir: Path) -> Comparison:
    client = mlflow_client(uri)
    runs = [gather(client, run) for run in find_runs(client, target)]
    if not runs:
        raise SystemExit(f"hydraddp.compare: no runs found for {target!r} at {uri}")
    rows = [row(run) for run in runs]
    best = best_runs(rows)
    text = table(rows) + ("\n\n" + _best_text(best, runs) if best else "")
    return Comparison(rows, text, plots(runs, out_dir), best, runs)


def default_out(target: str) -> Path:
    return DEFAULT_OUT / re.sub(r"[^\w.-]+", "_", target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hydraddp.compare", description=__doc__.strip().splitlines()[0])
    parser.add_argument("target", help="an experiment name, or a sweep's parent run id")
    parser.add_argument("--uri", default=None, help="tracking URI (default: sqlite mlflow.db here)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where the PNGs go (default: {DEFAULT_OUT}/TARGET, beside Hydra's outputs/)")
    args = parser.parse_args(argv)
    result = compare(args.target, args.uri or default_uri(), args.out or default_out(args.target))
    print(result.text)
    for path in result.plots:
        print(f"wrote {path}")
    return 0
