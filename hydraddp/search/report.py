"""How a search ended: its table (every trial, the best one or the Pareto front, why a trial failed or was not
launched) and its verdict for the exit status (``hydraddp.sweep``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydraddp.search.storage import ERROR

PLAN = "hydraddp_plan"  # a trial's user attribute: why its plan kept it from launching (over the memory budget)


def write_verdict(sweep_dir: Path, study_name: str, ended: dict[str, int]) -> None:
    """How this sweeper's trials ended, for the search's exit status and its parent run (``hydraddp.sweep``): a
    search every trial of which failed failed; one with some failed trials (each tried again) did not."""
    failed, total = ended.get("FAIL", 0), sum(ended.values())
    verdict = {"study": study_name, "ended": ended, "all_failed": total > 0 and failed == total}
    from hydraddp.sweep import SEARCH_VERDICT_FILE

    (sweep_dir / SEARCH_VERDICT_FILE).write_text(json.dumps(verdict, indent=1))
    if verdict["all_failed"]:
        print(f"hydraddp search: every trial failed ({failed} of {failed}); see each trial's log beside its "
              f"directory in {sweep_dir}", flush=True)
    elif failed:
        print(f"hydraddp search: {failed} of {total} trials failed (each was tried again)", flush=True)


def failure_line(error: str) -> str:
    """The line of a failed launch's output that says why: its ``hydraddp:`` verdict, with the first problem it
    lists (``- key=value ...``), else its last line."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if line.startswith("hydraddp:"):
            following = lines[i + 1] if i + 1 < len(lines) and lines[i + 1].startswith("- ") else ""
            return f"{line} {following}".strip()
    return lines[-1] if lines else error


def results_table(study: Any) -> str:
    """Every trial of the study with its value(s) and params, why a failed or unlaunched one ended, and the best
    trial, or a multi-objective study's Pareto front (its trials marked ``*``)."""
    multi = len(study.directions) > 1
    front = {t.number for t in study.best_trials} if multi else set()
    width = 12 * len(study.directions)
    rows = [f"{'trial':>6}  {'state':8} {'values' if multi else 'value':>{width}}  params"]
    for trial in study.get_trials(deepcopy=False):
        values = "".join(f"{v:12.6g}" for v in trial.values) if trial.values else "-".rjust(width)
        rows.append(f"{trial.number:>5}{'*' if trial.number in front else ' '}  {trial.state.name:8} {values}  "
                    + " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in trial.params.items()))
        why = trial.user_attrs.get(PLAN) or (trial.user_attrs.get(ERROR) if trial.state.name == "FAIL" else None)
        if why:
            rows.append(f"{'':>6}  {failure_line(why)}")
    if multi:
        best = (f"Pareto front (*): trials {', '.join(str(n) for n in sorted(front))}" if front
                else "no trial completed")
    else:
        try:
            best = f"best: trial {study.best_trial.number}, value {study.best_value:.6g}, {study.best_params}"
        except ValueError:
            best = "no trial completed"
    return "\nhydraddp search: study " + study.study_name + "\n" + "\n".join(rows) + "\n" + best
