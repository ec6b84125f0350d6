"""Compare the runs of an experiment or of a sweep: a table and two PNG plots.

    python -m hydraddp.compare EXPERIMENT_OR_PARENT_RUN [--uri URI] [--out DIR]
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from hydraddp.tracking import names
from hydraddp.tracking.run import default_uri, mlflow_client

COLUMNS = ("wrap", "precision", "world", "samples/s", "max rank p+g+o MB", "peak mem MB", "planned peak MiB",
           "tensor peak MiB", "plan error", "final loss", "status")


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


def _per_rank(metrics: dict[str, float], base: str) -> dict[int, float]:
    found = {}
    for key, value in metrics.items():
        match = re.fullmatch(rf"{re.escape(base)}/rank(\d+)", key)
        if match:
            found[int(match[1])] = value
    return found


def row(run: Any) -> dict[str, Any]:
    tags, metrics = run.data.tags, run.data.metrics
    per_rank_state = [sum(_per_rank(metrics, f"sharding/{f}").get(r, 0.0) for f in names.SHARDING_FIELDS[1:])
                      for r in _per_rank(metrics, "sharding/param_bytes")]
    return {
        "run_id": run.info.run_id,
        "wrap": tags.get(names.TAG_WRAP, "?"),
        "precision": tags.get(names.TAG_PRECISION, "?"),
        "world": tags.get(names.TAG_WORLD_SIZE, "?"),
        "samples/s": metrics.get(names.SAMPLES_PER_S),
        "max rank p+g+o MB": max(per_rank_state) / 1e6 if per_rank_state else None,
        "peak mem MB": metrics[f"{names.PEAK_MEMORY}/max"] / 1e6 if f"{names.PEAK_MEMORY}/max" in metrics else None,
        # The plan of rank 0 against what rank 0 measured over the second step (hydraddp/plan/).
        "planned peak MiB": int(run.data.params["plan/peak_bytes"]) / 2**20 if "plan/peak_bytes" in run.data.params else None,
        "tensor peak MiB": metrics[f"{names.PEAK_TENSOR}/rank0"] / 2**20 if f"{names.PEAK_TENSOR}/rank0" in metrics else None,
        "plan error": f"{metrics['plan/error/peak_bytes']:+.1%}" if "plan/error/peak_bytes" in metrics else None,
        "final loss": metrics.get(names.LOSS),
        "status": run.info.status,
    }


def table(rows: list[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4f}" if abs(value) < 10 else f"{value:,.1f}"
        return "-" if value is None else str(value)

    cells = [[cell(r[c]) for c in COLUMNS] for r in rows]
    widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in cells]
    return "\n".join(lines)


def plots(client: Any, runs: list[Any], out_dir: Path) -> list[Path]:
    """``loss_curves.png`` (train/loss of every run, overlaid) and ``memory_per_rank.png`` (peak bytes per rank)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    label = lambda run: f"{run.data.tags.get(names.TAG_WRAP, '?')}/{run.data.tags.get(names.TAG_PRECISION, '?')}"  # noqa: E731

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        history = sorted(client.get_metric_history(run.info.run_id, names.LOSS), key=lambda m: m.step)
        ax.plot([m.step for m in history], [m.value for m in history], marker=".", label=label(run))
    ax.set(xlabel="step", ylabel=names.LOSS, title="Training loss")
    ax.legend(fontsize="small")
    fig.tight_layout()
    loss_path = out_dir / "loss_curves.png"
    fig.savefig(loss_path, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    width, all_ranks = 0.8 / max(len(runs), 1), set()
    for i, run in enumerate(runs):  # one group of bars per rank, one bar per run (wrap/precision)
        peaks = _per_rank(run.data.metrics, names.PEAK_MEMORY)
        ranks = sorted(peaks)
        all_ranks.update(ranks)
        ax.bar([r - 0.4 + (i + 0.5) * width for r in ranks], [peaks[r] / 2**20 for r in ranks], width, label=label(run))
    ax.set_xticks(sorted(all_ranks))
    ax.set(xlabel="rank", ylabel="peak memory (MiB)", title="Peak memory per rank")
    ax.legend(fontsize="small")
    fig.tight_layout()
    memory_path = out_dir / "memory_per_rank.png"
    fig.savefig(memory_path, dpi=100)
    plt.close(fig)
    return [loss_path, memory_path]


def compare(target: str, uri: str, out_dir: Path) -> tuple[str, list[Path]]:
    client = mlflow_client(uri)
    runs = find_runs(client, target)
    if not runs:
        raise SystemExit(f"hydraddp.compare: no runs found for {target!r} at {uri}")
    return table([row(r) for r in runs]), plots(client, runs, out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hydraddp.compare", description=__doc__.strip().splitlines()[0])
    parser.add_argument("target", help="an experiment name, or a sweep's parent run id")
    parser.add_argument("--uri", default=None, help="tracking URI (default: sqlite mlflow.db here)")
    parser.add_argument("--out", type=Path, default=None, help="where the PNGs go (default: ./compare-TARGET)")
    args = parser.parse_args(argv)
    text, paths = compare(args.target, args.uri or default_uri(), args.out or Path(f"compare-{args.target}"))
    print(text)
    for path in paths:
        print(f"wrote {path}")
    return 0
