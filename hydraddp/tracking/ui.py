"""What a person opens in MLflow's UI: the experiment in its "Model training" mode, and the links to a run, to a
sweep's runs and to their charts (no mlflow import here; the functions that write take a client).

MLflow 3's UI opens an experiment in its GenAI mode (traces, evaluation runs) unless told otherwise: the experiment's
``mlflow.experimentKind`` tag says so (MLflow's own API and earlier UIs read it), and the link's
``workflowType=machine_learning`` (which the 3.17 UI reads first). Its routes are a hash router's (``routes.tsx``):
``#/experiments/<id>/runs/<run id>`` is a run's page and ``#/experiments/<id>/runs`` the runs list, which reads
``searchFilter``, ``orderByKey``, ``compareRunsMode`` (TABLE, CHART) and ``viewStateShareKey``. The bare
``#/experiments/<id>`` redirects, and drops all of them.
"""

from __future__ import annotations

import sys
from typing import Any
from urllib.parse import quote, urlencode

from hydraddp.tracking.client import sqlite_path

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"  # the UI's "Model training" mode
# MLflow 3.17's UI takes its mode from the link (then the browser's last choice, then GenAI), not from the tag
TRAINING_MODE = "workflowType=machine_learning"
LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves a local store by default


def experiment_id(client: Any, name: str) -> str:
    """The id of experiment ``name``, created if it is new, and tagged for the UI's training mode unless its owner
    chose another kind. Two processes creating it at once (a sweep's parent and a job, two nodes) both get it."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            return client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: TRAINING_KIND})
        except MlflowException:  # created by another process meanwhile (RESOURCE_ALREADY_EXISTS)
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
    mark_training(client, found)
    return found.experiment_id


def mark_training(client: Any, experiment: Any) -> None:
    """Tag ``experiment`` (an MLflow ``Experiment``) for the training mode, unless it has a kind already."""
    if EXPERIMENT_KIND_TAG not in experiment.tags:
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)


def ui_base(uri: str) -> str | None:
    """The UI's address for tracking ``uri``: the server itself, ``LOCAL_UI`` for a local store that `mlflow ui`
    serves, None where neither applies (Databricks has its own links)."""
    if uri.startswith(("http://", "https://")):
        return uri.rstrip("/")
    if sqlite_path(uri) is not None or uri.startswith("file:"):
        return LOCAL_UI
    return None


def ui_command(uri: str) -> str | None:
    """The command that serves a local store's UI at ``LOCAL_UI``; None for a server, which serves its own."""
    if uri.startswith(("http://", "https://")) or ui_base(uri) is None:
        return None
    return f"{sys.executable} -m mlflow ui --backend-store-uri {uri}"


def run_url(base: str, experiment: str, run_id: str) -> str:
    return f"{base}/#/experiments/{experiment}/runs/{run_id}?{TRAINING_MODE}"


def runs_url(base: str, experiment: str, view: str | None = None, search_filter: str = "", order_by: str = "",
             chart: bool = False) -> str:
    """The runs list of ``experiment``: in a saved view (``hydraddp.tracking.view``), or filtered and sorted (the UI
    ignores a saved view when the link also carries a search), as a table or as charts."""
    query = {"viewStateShareKey": view} if view else {"searchFilter": search_filter, "orderByKey": order_by}
    query = {k: v for k, v in query.items() if v}
    if chart:
        query["compareRunsMode"] = "CHART"
    return f"{base}/#/experiments/{experiment}/runs?" + urlencode(query, quote_via=quote) + f"&{TRAINING_MODE}"


def open_lines(uri: str, links: list[tuple[str, str]]) -> str:
    """What to print so that a person sees ``links`` ((what, url) pairs): the links, after the command that serves
    the UI when the store is a local file."""
    command = ui_command(uri)
    lines = [f"  {command}    # serves the UI at {LOCAL_UI}, then open:"] if command else []
    lines += [f"  {what}: {url}" for what, url in links]
    return "\n".join(lines)
