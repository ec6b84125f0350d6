"""python -m hydraddp [overrides]: compose, validate, launch. The work happens in hydraddp.cli."""

import sys

import hydra
from omegaconf import DictConfig

from hydraddp import cli
from hydraddp.config.schema import register

register()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig):
    return cli.run(cfg)


if __name__ == "__main__":
    cli.main(main, sys.argv)
