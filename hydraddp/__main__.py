"""python -m hydraddp [overrides]: compose, validate, launch. The work happens in hydraddp.cli.

Workers spawned by torch's elastic agent import this module again (as ``__mp_main__``); everything heavy
sits under the ``__main__`` guard so they import none of Hydra for nothing.
"""

import time

STARTED_AT = time.time()  # before any import: perf/startup_s counts from here


def _main() -> None:
    import sys

    import hydra
    from omegaconf import DictConfig

    from hydraddp import cli
    from hydraddp.config.schema import register

    register()

    @hydra.main(version_base="1.3", config_path="conf", config_name="config")
    def main(cfg: DictConfig):
        return cli.run(cfg)

    cli.main(main, sys.argv, STARTED_AT)


if __name__ == "__main__":
    from hydraddp.exit_codes import exit_without_teardown

    exit_without_teardown(_main)
