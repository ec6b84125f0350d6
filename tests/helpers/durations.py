"""``python -m tests.helpers.durations JUNIT_XML``: write ``tests/durations.json``, each test file's seconds in a
run of the suite (``pytest --junitxml=...``). ``tests/conftest.py`` starts the longest files first, so that under
pytest-xdist's ``loadfile`` no long file starts last while the other worker has run out of work."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

PATH = Path(__file__).resolve().parents[1] / "durations.json"


def load() -> dict[str, float]:
    return json.loads(PATH.read_text()) if PATH.exists() else {}


def main(junit: str) -> None:
    seconds: Counter[str] = Counter()
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.get("classname"):
            seconds[case.get("classname").replace(".", "/") + ".py"] += float(case.get("time", 0))
    PATH.write_text(json.dumps({f: round(s) for f, s in seconds.most_common() if s >= 1}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
