"""mkdocs hooks (mkdocs.yml): the config reference page is generated at each build (docs/config_reference.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File

sys.path.insert(0, str(Path(__file__).resolve().parent))

import config_reference  # noqa: E402


def on_files(files, config):
    files.append(File.generated(config, "reference/config.md", content=config_reference.markdown()))
    return files
