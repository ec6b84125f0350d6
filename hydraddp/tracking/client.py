"""Where a launch's MLflow runs live, and the client that reaches them: what the run of node 0's tracker
(``run``), every other node's process (``node``) and the comparison share, with nothing of either.

Importing this module does not import mlflow; ``mlflow_client`` does, when it is called.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_uri(cwd: Path | None = None) -> str:
    return f"sqlite:///{(cwd or Path.cwd()).resolve() / 'mlflow.db'}"


def mlflow_client(uri: str):
    # We retry ourselves (the events file keeps every point); mlflow's own backoff would stall for minutes.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)
