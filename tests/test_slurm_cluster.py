"""scripts/slurm_test.sh brings deploy/slurm's cluster up for real and runs every check of scripts/slurm_checks/ on it
(root and Docker: in CI, beside the suite). Here: no check is left out of its default list."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_check_is_run_by_the_test_script():
    script = (REPO / "scripts" / "slurm_test.sh").read_text()
    [default] = re.findall(r"checks=\(([\w ]+)\)", script)
    checks = {p.stem for p in (REPO / "scripts" / "slurm_checks").glob("*.py")} - {"cluster"}
    assert set(default.split()) == checks
