"""``hydra/sweeper=hydraddp_optuna``, registered in Hydra's ConfigStore when Hydra scans its plugins. The settings
keep hydra-optuna-sweeper's names, and its sampler groups (``hydra/sweeper/sampler=tpe|random|cmaes|nsgaii|grid|qmc|
gp``, each optuna's sampler with the settings people set); ``metric``, ``pruner``, ``heartbeat_interval`` and
``grace_period`` are hydraddp's."""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class TPESamplerConf:
    _target_: str = "optuna.samplers.TPESampler"
    seed: Optional[int] = None
    n_startup_trials: int = 10
    n_ei_candidates: int = 24
    multivariate: bool = False
    group: bool = False
    constant_liar: bool = False  # parallel trials: the running ones count as bad, so they are not asked again


@dataclass
class RandomSamplerConf:
    _target_: str = "optuna.samplers.RandomSampler"
    seed: Optional[int] = None


@dataclass
class CmaEsSamplerConf:  # needs the cmaes package (pip install 'hydraddp[search]')
    _target_: str = "optuna.samplers.CmaEsSampler"
    seed: Optional[int] = None
    sigma0: Optional[float] = None
    n_startup_trials: int = 1
    restart_strategy: Optional[str] = None  # ipop or bipop
    popsize: Optional[int] = None
    use_separable_cma: bool = False
    with_margin: bool = False
    consider_pruned_trials: bool = False


@dataclass
class NSGAIISamplerConf:  # multi-objective
    _target_: str = "optuna.samplers.NSGAIISampler"
    seed: Optional[int] = None
    population_size: int = 50
    mutation_prob: Optional[float] = None
    crossover_prob: float = 0.9
    swapping_prob: float = 0.5


@dataclass
class GridSamplerConf:  # search_space {}: every choice()/range() of the search space, each combination once
    _target_: str = "optuna.samplers.GridSampler"
    search_space: Dict[str, Any] = field(default_factory=dict)
    seed: Optional[int] = None


@dataclass
class QMCSamplerConf:
    _target_: str = "optuna.samplers.QMCSampler"
    seed: Optional[int] = None
    qmc_type: str = "sobol"  # or halton
    scramble: bool = False


@dataclass
class GPSamplerConf:  # Gaussian process (torch, scipy)
    _target_: str = "optuna.samplers.GPSampler"
    seed: Optional[int] = None
    n_startup_trials: int = 10
    deterministic_objective: bool = False


SAMPLERS = {"tpe": TPESamplerConf, "random": RandomSamplerConf, "cmaes": CmaEsSamplerConf,
            "nsgaii": NSGAIISamplerConf, "grid": GridSamplerConf, "qmc": QMCSamplerConf, "gp": GPSamplerConf}


@dataclass
class HydraddpOptunaSweeperConf:
    _target_: str = "hydra_plugins.hydraddp_optuna_sweeper.sweeper.HydraddpOptunaSweeper"
    _recursive_: bool = False  # the sweeper makes its sampler itself: a missing package is an exit 2 naming it
    defaults: List[Any] = field(default_factory=lambda: [{"sampler": "tpe"}])
    n_trials: int = 20  # trials in the study, done (COMPLETE, PRUNED) or running; a failed one is tried again
    n_jobs: int = 1  # trials running at once (each a launch of launcher.nproc_per_node processes)
    direction: Any = "minimize"  # or maximize; a list, one per metric, for a multi-objective search
    storage: Optional[str] = None  # an optuna storage URL; None: sqlite:///optuna.db in the working directory
    study_name: Optional[str] = None  # None: named by the search space, metric and fixed overrides
    sampler: Any = MISSING  # hydra/sweeper/sampler=NAME (default tpe), its settings hydra.sweeper.sampler.*
    params: Optional[Dict[str, str]] = None  # key: search space, beside those on the command line
    metric: Any = "eval/loss"  # the trial's value: the metric's last value (eval/<name>, train/loss, perf/...,
    # memory/peak_gib); a list of them is a multi-objective search (its Pareto front)
    pruner: str = "none"  # none, median or hyperband: reported at each evaluation, by rank 0
    heartbeat_interval: int = 30  # s between the sweeper's beats for each running trial (hydraddp.search.storage)
    grace_period: int = 120  # s without a beat after which any sweeper fails the trial (and the study retries it)
    memory_budget_gb: Optional[float] = None  # per rank: a trial whose plan's peak is over it is PRUNED unlaunched
    # (a trial's own plan.budget_gb comes first)


store = ConfigStore.instance()
for name, node in SAMPLERS.items():
    store.store(group="hydra/sweeper/sampler", name=name, node=node, provider="hydraddp")
store.store(group="hydra/sweeper", name="hydraddp_optuna", node=HydraddpOptunaSweeperConf, provider="hydraddp")
