"""The MLflow names of the contract, and the flattening and truncation of params (no mlflow here; redaction is
``hydraddp.redaction``)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

TAG_BACKEND, TAG_WRAP, TAG_PRECISION, TAG_OFFLOAD, TAG_WORLD_SIZE = (
    "hydraddp.backend", "hydraddp.wrap", "hydraddp.precision", "hydraddp.offload", "hydraddp.world_size")
CONTRACT_TAGS = (TAG_BACKEND, TAG_WRAP, TAG_PRECISION, TAG_OFFLOAD, TAG_WORLD_SIZE)
# On a resumed run: a JSON list, one entry per resume, of the checkpoint and step it resumed from and the
# contract tags the run had until then (the tags themselves always say what the run runs with now).
TAG_RESUMED_FROM = "hydraddp.resumed_from"
TAG_MESH = "hydraddp.mesh"  # fsdp2, ddp, pipeline stages: the device mesh, e.g. dp_replicate=2,dp_shard=2,tp=1
TAG_PRETRAINED = "hydraddp.pretrained"  # model.pretrained: the weights the run started from (a path)
TAG_MODEL, TAG_TASK = "hydraddp.model", "hydraddp.task"  # the _target_ classes of the model and the task
TAG_PREEMPTED = "hydraddp.preempted"  # JSON: the step, checkpoint and signal of the latest preemption
TAG_REQUEUES = "hydraddp.requeued"  # how many preemptions this run was resumed from (submitit requeues, reruns)
TAG_MODEL_CLASS = "hydraddp.model_class"  # the class the model's _target_ built (a factory's product), from rank 0
TAG_JOB_DIR = "hydraddp.job_dir"  # where the launch's files are (the other nodes find the run by it)
TAG_SWEEP = "hydraddp.sweep"  # on a sweep's parent run: its overrides
TAG_SWEEP_ID = "hydraddp.sweep_id"  # on a sweep's parent and its jobs' runs: the parent's run id (one UI filter)
TAG_ERROR = "hydraddp.error"  # on a FAILED run: the worker's error
TAG_PARENT = "mlflow.parentRunId"

LOSS, SAMPLES_PER_S, STEP_TIME_S, MFU = "train/loss", "perf/samples_per_s", "perf/step_time_s", "perf/mfu"
STARTUP_S = "perf/startup_s"  # from the launch command to the end of the first optimizer step
PP_BUBBLE = "perf/pp_bubble"  # under pipeline parallel: the share of the last step the tracking rank's stage waited
RUN_ID_FILE = "mlflow_run_id"  # in the job directory, once the tracker has created (or continued) the run
LAUNCHED_AT_ENV = "HYDRADDP_LAUNCHED_AT"  # the command's start (time.time()), set for the workers to inherit
EVAL_LOSS, EVAL_ACCURACY = "eval/loss", "eval/accuracy"


# The fields a run name's template (tracking.run_name) may use: none can carry a URI or a secret.
RUN_NAME_FIELDS = ("experiment", "wrap", "precision", "world", "backend", "offload", "model", "swept", "id")
SWEPT_KEYS_ENV = "HYDRADDP_SWEPT_KEYS"  # set by a sweep for its jobs: the keys it varies, as JSON
RUN_ID_CHARS = 4  # {id}: the first characters of the MLflow run id, so the name leads to the run
NAME_SEPARATORS = "-_. /"


def run_name_fields(config: dict[str, Any], wrap: str, world_size: int, experiment: str | None) -> dict[str, str]:
    """Every field of ``RUN_NAME_FIELDS`` but ``id`` (known once the run exists), from a resolved config."""
    target = str(config["model"].get("_target_", ""))
    return {"experiment": experiment or "", "wrap": wrap, "precision": config["precision"]["name"],
            "world": str(world_size), "backend": config["backend"]["name"], "offload": config["offload"]["name"],
            "model": target.rsplit(".", 1)[-1].lower()}


def swept_keys(overrides: Iterable[str]) -> list[str]:
    """The keys a sweep's overrides vary (``wrap=ddp,fsdp2`` and ``lr=interval(...)`` do, ``precision=bf16`` not)."""
    keys = []
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and SWEPT_VALUE.search(value) and "://" not in value:
            keys.append(_bare_key(key))
    return keys


def swept_label(overrides: Iterable[str], keys: Iterable[str]) -> str:
    """What one job of a sweep varies, from its own overrides: ``ddp-bf16`` for the keys ``wrap`` and ``precision``;
    a key that is not a config group says its name (``lr=0.001``)."""
    wanted, shown = set(keys), []
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and _bare_key(key) in wanted:
            key = _bare_key(key)
            shown.append(value if "." not in key else f"{key.rsplit('.', 1)[-1]}={value}")
    return "-".join(shown)


def _bare_key(key: str) -> str:
    """``+experiment@_global_`` -> ``experiment``."""
    return key.lstrip("+~").split("@", 1)[0]


def run_name(template: str, fields: dict[str, str]) -> str:
    """``template`` filled in; a field left empty drops out with the separator before it (``{experiment}-{wrap}``
    with no experiment is ``ddp``). A field not in ``fields`` stays as ``{name}``, to be filled in later (``{id}``)."""
    parts = re.split(r"(\{[a-z_]+\})", template)
    out = ""
    for part in parts:
        match = re.fullmatch(r"\{([a-z_]+)\}", part)
        if match is None:
            out += part
        elif match[1] not in fields:
            out += part
        elif fields[match[1]]:
            out += fields[match[1]]
        else:
            out = out.rstrip(NAME_SEPARATORS) if out.strip(NAME_SEPARATORS) else ""
    return re.sub(rf"([{re.escape(NAME_SEPARATORS)}])\1+", r"\1", out).strip(NAME_SEPARATORS)


def run_name_problem(template: str, key: str = "tracking.run_name") -> str | None:
    """Why ``template`` (the value of ``key``) cannot name runs, or None."""
    unknown = sorted(set(re.findall(r"\{([^{}]*)\}", template)) - set(RUN_NAME_FIELDS))
    if unknown:
        return (f"{key}={template!r} uses {', '.join('{' + u + '}' for u in unknown)}, which is not a "
                f"field of a run name")
    if not run_name(template, {k: "x" for k in RUN_NAME_FIELDS}):
        return f"{key}={template!r} names every run with an empty string"
    return None


SWEPT_VALUE = re.compile(r",|^(range|choice|glob|interval|tag)\(")


def sweep_run_name(overrides: Iterable[str]) -> str:
    """A sweep's parent run name: ``sweep`` and what it sweeps (``sweep wrap=ddp,fsdp2 precision=fp32,bf16``), plus its
    ``experiment=``. Nothing else of the overrides (a server's URI, a path) reaches the name; secrets come redacted."""
    shown = []
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and (swept_keys([override]) or _bare_key(key) == "experiment"):
            shown.append(f"{key.split('@', 1)[0]}={value}")
    return " ".join(["sweep", *shown])


def experiment_choice(overrides: Iterable[str]) -> str | None:
    """The ``experiment=NAME`` of a launch's overrides (Hydra spells it ``experiment@_global_=NAME``)."""
    for override in overrides:
        key, sep, value = override.lstrip("+~").partition("=")
        if sep and key.split("@", 1)[0] == "experiment" and value not in ("", "null"):
            return value
    return None


def eval_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """A task's evaluation metrics under their MLflow names: ``eval/<name>`` (eval/loss, eval/accuracy, ...)."""
    return {f"eval/{name}": value for name, value in metrics.items()}
SHARDING_FIELDS = ("param_numel", "param_bytes", "grad_bytes", "optim_state_bytes")
PEAK_MEMORY = "memory/peak_bytes"
BUILD_PEAK_MEMORY = "memory/build_peak_bytes"  # the same peak when training began: model built, wrapped and loaded
PEAK_TENSOR = "memory/peak_tensor_bytes"  # torch's tensor accounting over the second step (what the plan predicts)
PLAN_FILE = "plan.json"  # in the job directory and as an artifact: the launch's plan (hydraddp/plan/estimate.py)
PLAN_PARAMS = ("wrap", "world_size", "rank", "param_bytes", "grad_bytes", "optim_state_bytes", "unsharded_unit_bytes",
               "activation_bytes", "temporary_bytes", "peak_bytes", "peak_margin_bytes", "batch_per_rank", "build",
               "build_bytes")
# plan/error/<part>: (planned - measured) / measured, for rank 0, once the run has measured that part.
PLAN_CHECKED = {"param_bytes": "sharding/param_bytes/rank0", "grad_bytes": "sharding/grad_bytes/rank0",
                "optim_state_bytes": "sharding/optim_state_bytes/rank0", "peak_bytes": f"{PEAK_TENSOR}/rank0"}

AGGREGATES = ("max", "min", "mean")

TRUNCATED = "...[truncated; full value in config.yaml]"
MAX_PARAM_LENGTH = 6000  # MLflow's limit on a param value
MAX_TAG_LENGTH = 8000  # MLflow's limit on a tag value


def per_rank_metrics(base: str, values: list[float]) -> dict[str, float]:
    """``base/rank{r}`` for every rank plus ``base/max``, ``/min`` and ``/mean``. A size in bytes (``..._bytes``) is
    also logged in MiB (``..._mib``), which MLflow's charts print readably."""
    metrics = {f"{base}/rank{rank}": float(v) for rank, v in enumerate(values)}
    metrics.update({f"{base}/max": float(max(values)), f"{base}/min": float(min(values)),
                    f"{base}/mean": float(sum(values) / len(values))})
    if base.endswith("_bytes"):
        metrics.update(per_rank_metrics(mib_key(base), [v / MIB for v in values]))
    return metrics


MIB = 2**20


def mib_key(base: str) -> str:
    """``memory/peak_bytes`` -> ``memory/peak_mib``."""
    return base.removesuffix("_bytes") + "_mib"


def sharding_metrics(reports: list[dict[str, Any]]) -> dict[str, float]:
    """The contract's ``sharding/*`` metrics from every rank's WrapReport (numel is the local shard's)."""
    metrics: dict[str, float] = {}
    for name in SHARDING_FIELDS:
        key = "local_numel" if name == "param_numel" else name
        metrics.update(per_rank_metrics(f"sharding/{name}", [r[key] for r in reports]))
    return metrics


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists stay whole values."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def params(resolved_redacted: dict[str, Any]) -> dict[str, str]:
    """MLflow params: flattened, stringified, each cut to MLflow's limit with a marker."""
    out = {}
    for key, value in flatten(resolved_redacted).items():
        text = str(value)
        if len(text) > MAX_PARAM_LENGTH:
            text = text[: MAX_PARAM_LENGTH - len(TRUNCATED)] + TRUNCATED
        out[key] = text
    return out


def plan_params(plan: dict[str, Any]) -> dict[str, str]:
    """The ``plan/*`` params of a run: the planned parts of rank 0, its unit count and why it may be off."""
    if "error" in plan:
        return {"plan/error": str(plan["error"])[:MAX_PARAM_LENGTH]}
    params = {f"plan/{key}": str(plan[key]) for key in PLAN_PARAMS}
    params["plan/units"] = str(len(plan["units"]))
    params["plan/unsure"] = "; ".join(plan["unsure"])[:MAX_PARAM_LENGTH] or "no"
    return params


def plan_errors(plan: dict[str, Any], measured: dict[str, float]) -> dict[str, float] | None:
    """``plan/error/<part>`` once every checked part was measured (``measured``: metric key -> value), else None."""
    if "error" in plan or not all(key in measured for key in PLAN_CHECKED.values()):
        return None
    errors = {}
    for part, key in PLAN_CHECKED.items():
        real = measured[key]
        errors[f"plan/error/{part}"] = (plan[part] - real) / real if real else float(plan[part] - real)
    return errors
