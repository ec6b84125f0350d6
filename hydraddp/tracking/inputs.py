"""The ``input`` events of the tracking rank (``hydraddp.train.inputs``) as the run's MLflow dataset inputs.

Each is logged as MLflow's own numpy datasets are: source type ``code`` (``CodeDatasetSource``, here holding the
dataset's ``_target_`` and kwargs), a ``mlflow_tensorspec`` schema of features and targets, and the context as the
``mlflow.data.context`` input tag (``train`` / ``eval``, as MLflow's autologgers write it). MLflow keeps one input
per (name, digest) and run: a continued run, or an event sent again after a failed request, adds nothing.
"""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger(__name__)
SOURCE_TYPE = "code"  # mlflow.data.code_dataset_source.CodeDatasetSource: data made by code
CONTEXT_TAG = "mlflow.data.context"  # mlflow.utils.mlflow_tags.MLFLOW_DATASET_CONTEXT


def _specs(fields: list[dict[str, Any]], keyed: bool) -> str:
    """MLflow's ``Schema.to_json()`` of tensor specs, a batch dimension (-1) first. As for numpy data, a dict's
    fields are named by their keys and a lone array goes unnamed."""
    specs = []
    for leaf in fields:
        shape = [-1, *leaf["shape"]] if leaf["shape"] is not None else [-1]
        spec = {"type": "tensor", "tensor-spec": {"dtype": leaf["dtype"], "shape": shape}}
        specs.append({"name": leaf["name"], **spec} if keyed or len(fields) > 1 else spec)
    return json.dumps(specs)


def tensorspec(schema: dict[str, Any]) -> str:
    """The schema MLflow writes for a numpy dataset (``TensorDatasetSchema``): features and targets, where the
    targets are what the tasks take as labels (the second of an (inputs, targets) pair, a dict's ``labels``)."""
    fields, sample = schema["fields"], schema["sample"]
    if sample == "tuple" and {f["name"].split(".", 1)[0] for f in fields} == {"0", "1"}:
        is_target = [f["name"].split(".", 1)[0] == "1" for f in fields]
    elif sample == "dict" and len({f["name"].split(".", 1)[0] for f in fields}) > 1:
        is_target = [f["name"].split(".", 1)[0] == "labels" for f in fields]
    else:
        is_target = [False] * len(fields)
    features = [f for f, target in zip(fields, is_target) if not target]
    targets = [f for f, target in zip(fields, is_target) if target]
    keyed = sample == "dict"
    return json.dumps({"mlflow_tensorspec": {"features": _specs(features, keyed),
                                             "targets": _specs(targets, keyed) if targets else None}})


def dataset_input(payload: dict[str, Any]):
    """The ``DatasetInput`` of one ``input`` event."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    dataset = Dataset(name=payload["name"], digest=payload["digest"], source_type=SOURCE_TYPE,
                      source=json.dumps({"tags": payload["source"]}), schema=tensorspec(payload["schema"]),
                      profile=json.dumps(payload["profile"]))
    return DatasetInput(dataset, tags=[InputTag(CONTEXT_TAG, payload["context"])])


def log_input(run: Any, payload: dict[str, Any]) -> None:
    """``RECORD_HANDLERS["input"]``: one dataset input of ``run``. A request the server refuses (4xx) is left out
    with a warning; anything else (the server is away) raises, and the event is sent again."""
    from mlflow.exceptions import MlflowException

    try:
        run._client.log_inputs(run.run_id, datasets=[dataset_input(payload)])
    except MlflowException as exc:
        if not 400 <= exc.get_http_status_code() < 500:
            raise
        log.warning("the %s set %s was not logged as an input of run %s (%s)", payload.get("context"),
                    payload.get("name"), run.run_id, exc)
