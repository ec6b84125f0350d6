"""Compose hydraddp's configuration from Python (tests, notebooks, your own scripts)."""

from __future__ import annotations

from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig

from hydraddp.config.overrides import normalize_overrides
from hydraddp.config.schema import register

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose(overrides: list[str] | None = None, return_hydra_config: bool = False) -> DictConfig:
    """The composed config for ``overrides``, exactly as ``python -m hydraddp`` would build it.

    >>> cfg = compose(["wrap=fsdp2", "precision=bf16"])  # doctest: +SKIP
    >>> model, report = hydraddp.build_model(cfg)        # doctest: +SKIP
    """
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=normalize_overrides(overrides or []),
                             return_hydra_config=return_hydra_config)
