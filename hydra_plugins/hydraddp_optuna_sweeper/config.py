"""``hydra/sweeper=hydraddp_optuna``, registered in Hydra's ConfigStore when Hydra scans its plugins. The settings
keep hydra-optuna-sweeper's names; ``metric`` and ``pruner`` are hydraddp's."""

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class HydraddpOptunaSweeperConf:
    _target_: str = "hydra_plugins.hydraddp_optuna_sweeper.sweeper.HydraddpOptunaSweeper"
    n_trials: int = 20  # trials in the study, done (COMPLETE, PRUNED) or running; a failed one is tried again
    n_jobs: int = 1  # trials running at once (each a launch of launcher.nproc_per_node processes)
    direction: str = "minimize"  # or maximize
    storage: Optional[str] = None  # an optuna storage URL; None: sqlite:///optuna.db in the working directory
    study_name: Optional[str] = None  # None: named by the search space, metric and fixed overrides
    sampler: Any = field(default_factory=lambda: {"_target_": "optuna.samplers.TPESampler", "seed": None})
    params: Optional[Dict[str, str]] = None  # key: search space, beside those on the command line
    metric: str = "eval/loss"  # the trial's value: the metric's last value (eval/<name>, train/loss, perf/...)
    pruner: str = "none"  # none, median or hyperband: reported at each evaluation, by rank 0
    heartbeat_interval: int = 30  # s between the sweeper's beats for each running trial (hydraddp.search.storage)
    grace_period: int = 120  # s without a beat after which any sweeper fails the trial (and the study retries it)


ConfigStore.instance().store(group="hydra/sweeper", name="hydraddp_optuna", node=HydraddpOptunaSweeperConf,
                             provider="hydraddp")
