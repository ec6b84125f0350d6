"""The config reference (docs/reference/config.md), generated from what defines the config: every key of the composed
default config and of every option of every group, with its type (the schema's annotation, or its value's), its
default and its meaning (the comment beside it in the option's yaml, else in ``hydraddp/config/schema.py``).

mkdocs builds the page from this (docs/hooks.py); ``tests/test_docs.py`` fails on a key without a meaning.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"
SCHEMA = REPO / "hydraddp" / "config" / "schema.py"
# The groups as conf/config.yaml lists them; hydra's own keys are Hydra's documentation's.
GROUPS = ("backend", "wrap", "precision", "offload", "launcher", "task", "data", "model", "optim", "trainer",
          "tracking", "checkpoint")
# Hydra's own keys of a node that ``hydra.utils.instantiate`` builds.
INSTANTIATE_KEYS = {"_target_": "what is built: a class or function by its dotted path (your own too)",
                    "_partial_": "built as a partial, completed by hydraddp (the optimizer with the parameters, the "
                                 "scheduler with the optimizer)"}
LINE = re.compile(r"^(?P<indent>\s*)(?P<key>[\w@.-]+):(?P<value>[^#]*?)\s*(?:#\s?(?P<comment>.*))?$")


@dataclass(frozen=True)
class Entry:
    key: str  # dotted, from the config's root
    type: str
    default: str
    meaning: str


def _yaml_comments(path: Path, prefix: str) -> dict[str, str]:
    """``{dotted key: comment}`` of an option's yaml: the comment on a key's line, else the comment lines just above
    it. Keys are under ``prefix`` (the group's place in the config; ``# @package _global_`` files have none)."""
    comments: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    above: list[str] = []
    for raw in path.read_text().splitlines():
        if raw.strip().startswith("#"):
            above.append(raw.strip().lstrip("#").strip())
            continue
        match = LINE.match(raw)
        if not match or raw.strip().startswith("-"):
            above = []
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match["key"]))
        key = ".".join(part for part in [prefix, *(k for _, k in stack)] if part)
        comment = match["comment"] or " ".join(above)
        if comment:
            comments[key] = comment
        above = []
    return comments


def _schema_fields() -> dict[str, tuple[str, str]]:
    """``{dotted key: (annotation, comment)}`` from schema.py: each dataclass field's annotation and its comment (on
    its line, or the comment lines just above), placed by following ``Config``'s fields down."""
    source = SCHEMA.read_text()
    lines = source.splitlines()
    classes = {node.name: node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)}
    found: dict[str, tuple[str, str]] = {}

    def comment_of(node: ast.AnnAssign) -> str:
        line = lines[node.lineno - 1]
        if "#" in line:
            return line.split("#", 1)[1].strip()
        above, number = [], node.lineno - 2
        while number >= 0 and lines[number].strip().startswith("#"):
            above.insert(0, lines[number].strip().lstrip("#").strip())
            number -= 1
        return " ".join(above)

    def walk(class_name: str, prefix: str) -> None:
        for node in classes[class_name].body:
            if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
                continue
            key = f"{prefix}{node.target.id}"
            annotation = ast.unparse(node.annotation)
            found[key] = (annotation, comment_of(node))
            if annotation in classes:
                walk(annotation, key + ".")

    walk("Config", "")
    return found


def _flat(node: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _flat(value, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, node


def _type_of(value: Any) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "dict",
            type(None): "null"}.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def options() -> dict[str, list[str]]:
    """Every group's options, from conf/ (``hydra/launcher`` too: hydraddp's Slurm preset)."""
    return {group: sorted(p.stem for p in (CONF / group).glob("*.yaml")) for group in GROUPS}


def _composed(overrides: list[str]) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from hydraddp.config.compose import compose

    config = OmegaConf.to_container(compose(overrides), resolve=False)
    config.pop("hydra", None)
    return config


def entries(overrides: list[str] | None = None, only: str | None = None) -> list[Entry]:
    """The reference entries of the config ``overrides`` composes (the default config without), or of its ``only``
    group (an option's own keys)."""
    config = _composed(overrides or [])
    schema = _schema_fields()
    comments: dict[str, str] = {}
    for group in GROUPS:
        choice = next((o.split("=", 1)[1] for o in overrides or [] if o.startswith(f"{group}=")), None)
        for path in [CONF / group / f"{choice}.yaml"] if choice else (CONF / group).glob("*.yaml"):
            if choice or path.stem == _default_option(group):
                comments.update(_yaml_comments(path, group))
    made = []
    for key, value in _flat(config, ""):
        if only and not (key == only or key.startswith(only + ".")):
            continue
        annotation, schema_comment = schema.get(key, ("", ""))
        if annotation == "Any":
            annotation = "any"
        elif not annotation or annotation.endswith("Config"):
            annotation = _type_of(value)
        meaning = comments.get(key) or schema_comment or INSTANTIATE_KEYS.get(key.rpartition(".")[2], "")
        made.append(Entry(key, annotation, _shown(value), meaning))
    return made


def _default_option(group: str) -> str:
    for line in (CONF / "config.yaml").read_text().splitlines():
        match = re.match(rf"\s*- {group}: (\S+)", line)
        if match:
            return match[1]
    raise KeyError(group)


def _table(rows: list[Entry]) -> list[str]:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    return ["| key | type | default | meaning |", "|---|---|---|---|",
            *(f"| `{cell(e.key)}` | {cell(e.type)} | `{cell(e.default)}` | {cell(e.meaning)} |" for e in rows), ""]


def markdown() -> str:
    """The whole page."""
    out = ["# Config reference", "",
           "Every key of the composed default config (`python -m hydraddp --cfg job` prints it), then what each option "
           "of each group sets. Generated from `conf/` and `hydraddp/config/schema.py` at each build of this site: "
           "a key without a comment there fails `tests/test_docs.py`.", "", "## The default config", ""]
    default = entries()
    for group in [*GROUPS, "plan", "mesh"]:
        rows = [e for e in default if e.key == group or e.key.startswith(group + ".")]
        out += [f"### {group}", "", *_table(rows)]
    out += ["## Each group's options", ""]
    for group, names in options().items():
        for name in names:
            out += [f"### `{group}={name}`", "", *_table(entries([f"{group}={name}"], only=group))]
    return "\n".join(out)


def undocumented() -> list[str]:
    """Keys of the default config and of every option that have no meaning: what the test reports."""
    missing = {e.key for e in entries() if not e.meaning}
    for group, names in options().items():
        for name in names:
            missing |= {f"{e.key} ({group}={name})" for e in entries([f"{group}={name}"], only=group) if not e.meaning}
    return sorted(missing)


if __name__ == "__main__":
    print(markdown())
