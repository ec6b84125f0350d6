"""Whether a launch's tracking store can be used, found before any worker starts and without importing mlflow: an
HTTP server must answer /health and serve its API to us (MLflow 3's server checks the Host header, and may ask for
credentials); a file store must be writable."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path

from hydraddp.tracking.client import sqlite_path


def preflight(uri: str, timeout_s: float = 5.0, api_timeout_s: float = 60.0) -> str | None:
    """Why ``uri`` cannot be used, or None. An HTTP server must answer /health within ``timeout_s`` and serve its API
    to us within ``api_timeout_s``: longer, because a server that answered /health is up, and each of its workers opens
    its database on its first API request (a PostgreSQL store on a busy node took more than 5 s on a real Slurm
    cluster in containers). A file store must be writable."""
    if uri.startswith(("http://", "https://")):
        base = uri.rstrip("/")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=timeout_s) as response:
                if response.status != 200:
                    return f"the MLflow server at {uri} answered /health with HTTP {response.status}"
        except urllib.error.HTTPError as exc:
            return f"the MLflow server at {uri} answered /health with HTTP {exc.code}"
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            return f"the MLflow server at {uri} cannot be reached ({reason})"
        return _api_refusal(base, api_timeout_s)
    path = sqlite_path(uri) or (uri.removeprefix("file://") if uri.startswith("file://") else None)
    if path is not None:
        folder = Path(path).parent if uri.startswith("sqlite:") else Path(path)
        while not folder.exists():
            folder = folder.parent
        if not os.access(folder, os.W_OK):
            return f"the MLflow store {uri} is not writable ({folder})"
    return None


# Why a server that is up refuses its API, by status, and what fixes it (MLflow 3's server checks the Host header).
REFUSAL_FIXES = {
    401: "give MLflow's credentials (MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN)",
    403: "start the server with --allowed-hosts naming the host and port in tracking.uri (MLflow 3 accepts only "
         "localhost and private addresses by default), or give credentials that may use it",
    404: "tracking.uri must be where the server serves MLflow's API: http://HOST:PORT, plus the server's "
         "--static-prefix if it has one",
}


def _api_refusal(base: str, timeout_s: float) -> str | None:
    """Why the server at ``base``, whose /health answered, refuses MLflow's API, or None. /health is exempt from the
    server's Host check and from authentication: a launch would train, and log nothing."""
    request = urllib.request.Request(f"{base}/api/2.0/mlflow/experiments/search?max_results=1",
                                     headers=_auth_headers())
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            return None
    except urllib.error.HTTPError as exc:
        said = " ".join(exc.read(300).decode(errors="replace").split()) or exc.reason
        fix = REFUSAL_FIXES.get(exc.code)
        return (f"the MLflow server at {base} answers /health but refuses its API with HTTP {exc.code}: {said!r}"
                + (f"; {fix}" if fix else ""))
    except (urllib.error.URLError, OSError) as exc:
        return (f"the MLflow server at {base} answers /health but not its API within {timeout_s:g} s "
                f"({getattr(exc, 'reason', exc)})")


def _auth_headers() -> dict[str, str]:
    """The credentials MLflow's client sends (``mlflow.utils.rest_utils``), from the same variables."""
    import base64

    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user and password:
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}
