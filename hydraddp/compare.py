"""python -m hydraddp.compare EXPERIMENT_OR_PARENT_RUN: a table of runs and PNG plots (see hydraddp.tracking.compare)."""

import sys

from hydraddp.tracking.compare import main

if __name__ == "__main__":
    sys.exit(main())
