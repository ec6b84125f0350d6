"""A search trial as its launch sees it: the spec the sweeper hands it in its environment (``TRIAL_ENV``), and on the
rank that evaluates first (rank 0), the metric reported at each evaluation to the study's storage, with the question
whether to prune. The training loop carries the answer to every rank in the collective that already carries the
ranks' agreement to stop (``train.preemption``); the sweeper's side is ``search/``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

# Set by the sweeper for its trial's launch: {"storage", "study", "trial_id", "number", "metric", "pruner", "keys"}
TRIAL_ENV = "HYDRADDP_TRIAL"
TAG_TRIAL, TAG_TRIAL_STATE = "hydraddp.trial", "hydraddp.trial_state"  # on a trial's run: its number and state
TAG_PRUNED, TAG_PRUNED_STEP = "hydraddp.pruned", "hydraddp.pruned_step"
JOURNAL = "journal://"  # a study in a file on a shared file system (search.storage)


def journal_path(url: str) -> Path | None:
    """The file of a ``journal:///path`` storage, else None."""
    return Path(url.removeprefix(JOURNAL)) if url.startswith(JOURNAL) else None


def open_storage(url: str, heartbeat_interval: int | None = None, grace_period: int | None = None,
                 on_stale: Callable[[Any, Any], None] | None = None) -> Any:
    """The optuna storage of ``url``; for a sweeper, with the heartbeat (RDB) that fails a trial gone quiet for
    ``grace_period``, and ``on_stale(study, trial)`` told of each."""
    import optuna

    path = journal_path(url)
    if path is not None:
        from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

        path.parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(str(path), JournalFileOpenLock(str(path))))
    return optuna.storages.RDBStorage(url, heartbeat_interval=heartbeat_interval, grace_period=grace_period,
                                      heartbeat_stale_trial_callback=on_stale)


PRUNERS = ("none", "median", "hyperband")


def pruner(name: str) -> Any:
    """optuna's pruner of ``hydra.sweeper.pruner``: the median rule waits for two finished trials first."""
    import optuna

    return {"none": optuna.pruners.NopPruner(), "median": optuna.pruners.MedianPruner(n_startup_trials=2),
            "hyperband": optuna.pruners.HyperbandPruner()}[name]


def metric_value(metric: str, eval_metrics: dict[str, float], loss: float | None = None) -> float | None:
    """The value of ``metric`` (an MLflow name: ``eval/loss``, ``eval/accuracy``, ``train/loss``) among what an
    evaluation gave, or None."""
    if metric.startswith("eval/"):
        return eval_metrics.get(metric.removeprefix("eval/"))
    return loss if metric == "train/loss" else None


def describe(cfg: Any) -> str | None:
    """What this rank trains with of the searched keys (``trial 3: optim.optimizer.lr=0.01``), and on which GPUs,
    for its log; None outside a trial. Every rank logs it: the values are the ones its own config holds."""
    from omegaconf import OmegaConf

    spec = os.environ.get(TRIAL_ENV)
    if not spec:
        return None
    spec = json.loads(spec)
    values = " ".join(f"{key}={OmegaConf.select(cfg, key)!r}" for key in spec.get("keys", []))
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")  # the trial's share of the node's GPUs, when the sweeper split them
    return f"search trial {spec.get('number')}: {values}" + (f" (CUDA_VISIBLE_DEVICES={gpus})" if gpus else "")


class TrialReporter:
    """The trial of this launch, when the sweeper started it (``TRIAL_ENV``), else ``from_env`` gives None."""

    def __init__(self, spec: dict[str, Any]):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.metric = spec["metric"]
        # The pruner is not in the storage: each process that asks names its own (load_study's default is median's).
        study = optuna.load_study(study_name=spec["study"], storage=open_storage(spec["storage"]),
                                  pruner=pruner(spec["pruner"]))
        self.trial = optuna.Trial(study, spec["trial_id"])

    @classmethod
    def from_env(cls) -> TrialReporter | None:
        """The trial to report to; None outside a search, or in a multi-objective one (optuna prunes only
        single-objective studies: there is nothing to report)."""
        spec = json.loads(os.environ.get(TRIAL_ENV) or "null")
        return cls(spec) if spec and spec.get("metric") else None

    def should_prune(self, step: int, eval_metrics: dict[str, float], loss: float | None = None) -> bool:
        import optuna

        value = metric_value(self.metric, eval_metrics, loss)
        if value is None:
            return False
        try:
            self.trial.report(float(value), step)
        except optuna.exceptions.UpdateFinishedTrialError:
            return True  # the study ended the trial (its sweeper was lost): nobody waits for the rest
        return self.trial.should_prune()
