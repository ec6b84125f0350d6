"""python -m hydraddp.compare EXPERIMENT_OR_PARENT_RUN: a table of runs and PNG plots (see hydraddp.tracking.comparison)."""

from hydraddp.tracking.comparison import main

if __name__ == "__main__":
    from hydraddp.exit_codes import exit_without_teardown

    exit_without_teardown(main)
