"""ignite 0.5.5's own tests for ``idist`` pass against ``hydraddp.distributed``: every test that passes with ignite
on this machine passes with hydraddp, at one rank and at two (see README.md for the files and the skips).

ignite's own outcomes are kept in ``outcomes-ignite-<version>.json`` beside this file: the run against ignite itself
happens again only when the installed ignite has no such file, or on request (``HYDRADDP_IGNITE_BASELINE=1``),
and then writes the file. The run against hydraddp happens every time.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
UPSTREAM = HERE / "upstream"
RUN_LIMIT_S = 900
RERUN_VAR = "HYDRADDP_IGNITE_BASELINE"


def stored_outcomes_path() -> Path:
    return HERE / f"outcomes-ignite-{importlib.metadata.version('pytorch-ignite')}.json"


def _tree(root: Path, target: str) -> Path:
    """A copy of ignite's files; for hydraddp, with the one swap: ``ignite.distributed`` -> ``hydraddp.distributed``
    (not the test package's own ``tests.ignite.distributed``; and the launcher test's ``import ignite``, used to point PYTHONPATH at the package under test)."""
    tree = root / target
    shutil.copytree(UPSTREAM, tree)
    (tree / "pytest.ini").write_text("[pytest]\nmarkers =\n    distributed\n    multinode_distributed\n    tpu\n")
    if target == "hydraddp":
        for path in tree.rglob("*.py"):
            text = path.read_text()
            text = re.sub(r"(?<![\w.])ignite\.distributed", "hydraddp.distributed", text)
            text = text.replace("    import ignite\n", "    import hydraddp as ignite\n")
            path.write_text(text)
    return tree


def _outcomes(junit: Path) -> dict[str, str]:
    """test id -> passed/failed/skipped. At two ranks each id runs once per rank: it passes only if both pass."""
    rank_of = {"passed": 0, "skipped": 1, "failed": 2}
    outcomes: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        children = {child.tag for child in case}
        outcome = "failed" if children & {"failure", "error"} else "skipped" if "skipped" in children else "passed"
        if rank_of[outcome] >= rank_of.get(outcomes.get(test_id, "passed"), 0):
            outcomes[test_id] = outcome
    return outcomes


def _run(tree: Path, ranks: int) -> tuple[dict[str, str], str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # torchrun, horovodrun
    env.pop("WORLD_SIZE", None)
    env["CUDA_VISIBLE_DEVICES"] = ""
    junit = tree / f"junit-{ranks}.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(tree / "pytest.ini"),
               "--rootdir", str(tree), f"--junitxml={junit}", "-o", "junit_family=xunit1", "tests/ignite/distributed"]
    if ranks == 2:
        env["WORLD_SIZE"] = "2"
        command += ["-n", "2", "--dist=each", "-m", "distributed"]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=RUN_LIMIT_S)
    return _outcomes(junit), done.stdout[-6000:] + done.stderr[-3000:]


def ignite_outcomes(root: Path, ranks: int) -> dict[str, str]:
    """ignite's own outcomes at ``ranks``: from the stored file, or run (and stored) when it has none or on request."""
    path = stored_outcomes_path()
    stored = json.loads(path.read_text()) if path.exists() else {"ranks": {}}
    if os.environ.get(RERUN_VAR) != "1" and str(ranks) in stored["ranks"]:
        return stored["ranks"][str(ranks)]
    import torch

    outcomes, _ = _run(_tree(root, f"ignite-{ranks}"), ranks)
    stored.update({"ignite": importlib.metadata.version("pytorch-ignite"), "torch": torch.__version__,
                   "cuda": torch.cuda.is_available(),
                   "how": f"written by tests/ignite_reference/test_ignite_suite.py; {RERUN_VAR}=1 runs ignite again"})
    stored["ranks"][str(ranks)] = dict(sorted(outcomes.items()))
    path.write_text(json.dumps(stored, indent=1) + "\n")
    return outcomes


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_LIMIT_S + 60)
@pytest.mark.parametrize("ranks", [1, 2])
def test_every_test_ignite_passes_passes_with_hydraddp(tmp_path, ranks):
    baseline = ignite_outcomes(tmp_path, ranks)
    ours, output = _run(_tree(tmp_path, "hydraddp"), ranks)
    passed_with_ignite = {test for test, outcome in baseline.items() if outcome == "passed"}
    assert len(passed_with_ignite) >= 20, f"the baseline ran too few tests: {sorted(baseline.items())}"
    missing = sorted(test for test in passed_with_ignite if ours.get(test) != "passed")
    assert not missing, f"pass with ignite, not with hydraddp ({len(missing)}):\n" + "\n".join(missing) + "\n" + output
