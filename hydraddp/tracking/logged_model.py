"""The trained model as an MLflow LoggedModel of the launch's run: the tracker's handler of ``model`` events.

The ranks (``hydraddp.train.model_snapshot``) leave either a full state dict and an input example in
``<job dir>/model/step_NNNNNNNN/``, or, above ``tracking.model.max_copy_mb``, the path of a DCP checkpoint. The first
becomes ``mlflow.pytorch.log_model`` of the bare model the config builds, with a signature; the second an external
LoggedModel (``mlflow.create_external_model``) whose tags say where the weights are and how to export them. Both are
outputs of the run at their step, with the run's metrics of that step and its params.

No active run is needed and none is started: the run's status stays the launch's to set.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from hydraddp.tracking import names

log = logging.getLogger(__name__)
NAME = "model"  # the LoggedModel's name, as in mlflow.pytorch.log_model(name="model")
TAG_STEP, TAG_CHECKPOINT, TAG_LOAD = "hydraddp.step", "hydraddp.checkpoint", "hydraddp.load"
TAG_HF_EXPORT = "hydraddp.hf_export"  # above max_copy_mb, a transformers model's Hugging Face directory
PROGRESS_FILE = "logged_model.json"  # in the model's folder: {"model_id", "done"}; a retried event goes on from it


def _progress(folder: Path) -> dict[str, Any]:
    path = folder / PROGRESS_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def _write_progress(folder: Path, model_id: str, done: bool) -> None:
    path = folder / PROGRESS_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"model_id": model_id, "done": done}))
    os.replace(tmp, path)


def _server_may_be_away(exc: Exception) -> bool:
    """Worth sending again: no answer (MLflow reports a refused connection as a 500) or a server error."""
    from mlflow.exceptions import MlflowException

    if isinstance(exc, MlflowException):
        return exc.get_http_status_code() >= 500
    return isinstance(exc, OSError)  # requests' errors are OSErrors


def _no_pickle_warning(record: logging.LogRecord) -> bool:
    """The flavor warns at every pickled model; this one is pickled on purpose (``_log``)."""
    return "Pickle or CloudPickle" not in record.getMessage()


def _requirements(model: Any) -> list[str]:
    """torch, cloudpickle and the model class's own package, pinned as installed here: explicit, so that MLflow
    does not spend seconds inferring them."""
    from importlib.metadata import PackageNotFoundError, version

    pinned = []
    for package in dict.fromkeys(["torch", "cloudpickle", type(model).__module__.split(".")[0]]):
        try:
            pinned.append(f"{package}=={version(package)}")
        except PackageNotFoundError:
            pass
    return pinned


def warm_up() -> None:
    """Import what logging a model needs (torch, MLflow's pytorch flavor: about 3 CPU-seconds) while the ranks train,
    so that the launch's end waits for the logging alone."""
    import mlflow.pytorch  # noqa: F401  (imports torch)
    from mlflow.models import infer_signature  # noqa: F401


def _bare_model(payload: dict[str, Any]) -> Any:
    """The model the config builds, with the ranks' weights, in eval mode."""
    import torch

    from hydraddp.models.of_config import model_of

    model = model_of(payload["model_config"], "cpu", payload.get("hf_config"))
    model.load_state_dict(torch.load(payload["state_dict"], weights_only=True))
    return model.eval()


def _example_and_signature(model: Any, path: str | None) -> tuple[Any, Any]:
    """The input example (numpy) and the signature it gives ``model``. None for what cannot be made: no example (the
    launch took no step), or one the model does not take; no example either for a model whose output is not one
    tensor (MLflow's torch flavor serves one tensor out, and would fail to validate it): its signature says what
    goes in."""
    import torch
    from mlflow.models import infer_signature
    from mlflow.models.signature import ModelSignature

    if not path:
        return None, None
    try:
        example = torch.load(path, weights_only=True)
        with torch.no_grad():
            output = model(example)
        if isinstance(output, torch.Tensor):
            return example.numpy(), infer_signature(example.numpy(), output.numpy())
        return None, ModelSignature(inputs=infer_signature(example.numpy()).inputs)
    except Exception as exc:  # e.g. a dtype numpy lacks (bfloat16): the model goes without
        log.info("the model is logged without an input example (%s: %s)", type(exc).__name__, exc)
        return None, None


def _link(client: Any, source: Any, model_id: str, step: int) -> None:
    """The model as the run's (``source``) output at ``step``, with the run's metrics of that step (for the model's
    own view and ``search_logged_models`` filters). Every event before the model's was sent first: they are there,
    and none of a later step is."""
    from mlflow.entities import LoggedModelOutput, Metric

    run_id = source.info.run_id
    client.log_outputs(run_id, [LoggedModelOutput(model_id, step)])
    latest = getattr(source.data, "_metric_objs", [])  # each metric's latest point
    metrics = [Metric(m.key, m.value, m.timestamp, m.step, model_id=model_id, run_id=run_id)
               for m in latest if m.step == step]
    for i in range(0, len(metrics), 1000):  # MLflow's limit per request
        client.log_batch(run_id, metrics=metrics[i:i + 1000])


def _log(run: Any, payload: dict[str, Any], folder: Path, model: Any) -> str:
    """A LoggedModel of ``model``, or with ``model`` None of the checkpoint in ``payload``; its id."""
    import mlflow

    client, step = run._client, payload["step"]
    mlflow.set_tracking_uri(run.uri)  # the flavor's own calls use the fluent client
    source = client.get_run(run.run_id)
    previous = _progress(folder).get("model_id")
    if previous:  # an attempt the server did not see through: its half-logged model goes
        try:
            client.delete_logged_model(previous)
        except Exception as exc:
            if _server_may_be_away(exc):
                raise
    tags = {TAG_STEP: str(step), names.TAG_MODEL: str(payload.get("target"))}
    common = {"name": NAME, "source_run_id": run.run_id, "experiment_id": source.info.experiment_id,
              "params": names.params(run.config) if run.config else None}
    if model is None:  # above tracking.model.max_copy_mb: the checkpoint holds the weights
        checkpoint = payload["checkpoint"]
        tags.update({TAG_CHECKPOINT: checkpoint, TAG_LOAD: f"python -m hydraddp.export {checkpoint} OUT.pt"})
        if payload.get("hf_export"):  # a transformers model, exported beside it (hydraddp.train.model_snapshot)
            tags.update({TAG_HF_EXPORT: payload["hf_export"],
                         TAG_LOAD: f"transformers.AutoModelForCausalLM.from_pretrained({payload['hf_export']!r})"})
        model_id = mlflow.create_external_model(**common, tags=tags).model_id
        _write_progress(folder, model_id, done=False)
    else:
        example, signature = _example_and_signature(model, payload.get("input_example"))
        model_id = mlflow.initialize_logged_model(**common, tags=tags).model_id
        _write_progress(folder, model_id, done=False)
        # pickle, not MLflow's default pt2: torch.export costs the tracker seconds of CPU at the launch's end and
        # fails on models it cannot trace; the pickle loads wherever the model's package is installed.
        mlflow.pytorch.log_model(model, name=NAME, model_id=model_id, step=step, input_example=example,
                                 signature=signature, pip_requirements=_requirements(model),
                                 serialization_format="pickle")
    _link(client, source, model_id, step)
    return model_id


def log_model(run: Any, payload: dict[str, Any]) -> None:
    """The ``model`` event of ``run`` (a ``LaunchRun``) as a LoggedModel; once, even when the event comes again."""
    folder = Path(payload["folder"])
    if _progress(folder).get("done"):
        return
    began = time.perf_counter()
    try:
        model = _bare_model(payload) if payload.get("state_dict") else None
    except Exception as exc:  # nothing the server can change: never loggable
        log.warning("the model of step %s was not logged: it could not be rebuilt (%s: %s)", payload.get("step"),
                    type(exc).__name__, exc)
        return
    logging.getLogger("mlflow.pytorch").addFilter(_no_pickle_warning)  # once: the same filter is not added twice
    try:
        model_id = _log(run, payload, folder, model)
    except Exception as exc:
        if _server_may_be_away(exc):
            raise
        log.warning("the model of step %s was not logged (%s: %s)", payload.get("step"), type(exc).__name__, exc)
        return
    _write_progress(folder, model_id, done=True)
    if payload.get("state_dict"):
        Path(payload["state_dict"]).unlink(missing_ok=True)  # MLflow keeps the copy now
    log.info("LoggedModel %s (step %s) logged in %.1f s", model_id, payload["step"], time.perf_counter() - began)
