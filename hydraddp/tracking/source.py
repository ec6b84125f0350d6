"""What launched a run, under MLflow's own tag names: the user, the entry point, and the git commit and dirty state
of the working tree it was launched from (no mlflow here: the tracker adds these before it creates the run)."""

from __future__ import annotations

import getpass
import subprocess
import urllib.parse
from pathlib import Path

# mlflow.utils.mlflow_tags' names, spelled out so that the launcher never imports mlflow to use them
USER, SOURCE_TYPE, SOURCE_NAME = "mlflow.user", "mlflow.source.type", "mlflow.source.name"
GIT_COMMIT, GIT_BRANCH, GIT_DIRTY, GIT_REPO_URL = ("mlflow.source.git.commit", "mlflow.source.git.branch",
                                                   "mlflow.source.git.dirty", "mlflow.source.git.repoURL")
ENTRY_POINT = "mlflow.project.entryPoint"
GIT_TIMEOUT_S = 5.0


def _git(cwd: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def without_credentials(url: str) -> str:
    """A remote's URL without the user and password (``https://user:token@host/repo`` -> ``https://host/repo``)."""
    parts = urllib.parse.urlsplit(url)
    if not parts.netloc or "@" not in parts.netloc:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def git_tags(cwd: Path) -> dict[str, str]:
    """The commit, branch, remote and dirty state of the git working tree at ``cwd``; none outside one."""
    commit = _git(cwd, "rev-parse", "HEAD")
    if not commit:
        return {}
    tags = {GIT_COMMIT: commit}
    # Untracked files count as dirty too: a new module the run imports is part of what ran.
    status = _git(cwd, "status", "--porcelain")
    if status is not None:
        tags[GIT_DIRTY] = str(bool(status)).lower()
    branch = _git(cwd, "rev-parse", "--abbrev-ref", "HEAD")
    if branch and branch != "HEAD":
        tags[GIT_BRANCH] = branch
    remote = _git(cwd, "config", "--get", "remote.origin.url")
    if remote:
        tags[GIT_REPO_URL] = without_credentials(remote)
    return tags


def source_tags(cwd: Path, entry_point: str) -> dict[str, str]:
    """MLflow's source tags for a launch started in ``cwd`` by ``entry_point`` (``python -m hydraddp``)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        user = ""
    tags = {SOURCE_TYPE: "LOCAL", SOURCE_NAME: entry_point, ENTRY_POINT: entry_point, **git_tags(cwd)}
    if user:
        tags[USER] = user
    return tags
