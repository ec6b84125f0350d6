"""python -m hydraddp.tracking.sync JOB_DIR --uri URI [--status FINISHED]

Send the metric points a launch kept in JOB_DIR/events.jsonl while its MLflow server was away.
"""

import argparse
from pathlib import Path

from hydraddp.tracking.run import sync


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("job_dir", type=Path)
    parser.add_argument("--uri", required=True)
    parser.add_argument("--status", choices=["FINISHED", "FAILED", "KILLED"])
    args = parser.parse_args(argv)
    return sync(args.job_dir, args.uri, args.status)


if __name__ == "__main__":
    from hydraddp.exit_codes import exit_without_teardown

    exit_without_teardown(main)
