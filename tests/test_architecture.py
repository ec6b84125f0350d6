"""The package's shape, read from its source (no import, no process): imports point one way, functions stay short,
and the core names nothing of Hydra, OmegaConf or MLflow anywhere, not even in a function that imports lazily.

``test_seam.py`` checks what importing ``hydraddp.distributed`` loads at run time; the checks here see every module's
every ``import``, including the ones a test never reaches.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hydraddp"
MAX_FUNCTION_LINES = 60
# Import cycles another change is breaking, each as its modules sorted, with the issue that breaks it. None today.
KNOWN_CYCLES: set[tuple[str, ...]] = set()
# Functions another change is splitting, as "path under hydraddp/:name", with the issue. None today.
KNOWN_LONG_FUNCTIONS: set[str] = set()
CORE = ("distributed", "parallel")  # imports torch only (Horovod lazily)
FORBIDDEN_IN_CORE = ("hydra", "omegaconf", "mlflow")


@cache
def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name; a package by its own name."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


@cache
def _tree(module: str) -> ast.Module:
    return ast.parse(_modules()[module].read_text(), filename=str(_modules()[module]))


def _imports(module: str) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of ``module``: at module level, in functions, under ``if TYPE_CHECKING``."""
    for node in ast.walk(_tree(module)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def _own_module(name: str) -> str | None:
    """``name`` or the nearest package above it that is one of ours (``a.b.c`` where only ``a.b`` exists: ``a.b``)."""
    while name and name not in _modules():
        name = name.rpartition(".")[0]
    return name or None


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` names, relative imports resolved against ``module``."""
    if not node.level:
        return node.module or ""
    package = module if _modules()[module].name == "__init__.py" else module.rpartition(".")[0]
    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _dependencies(module: str) -> set[str]:
    """The package's modules that ``module`` imports. ``from a import b`` imports ``a.b`` when that is a module,
    else ``a``."""
    found = set()
    for node in _imports(module):
        if isinstance(node, ast.Import):
            found.update(_own_module(alias.name) for alias in node.names)
            continue
        source = _absolute(module, node)
        for alias in node.names:
            found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in _modules() else _own_module(source))
    return found - {None, module}


def import_graph() -> dict[str, set[str]]:
    return {module: _dependencies(module) for module in _modules()}


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module: the modules that import each other, directly or not."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest way round ``component``, from its first module back to it, for the failure message."""
    start = component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for successor in sorted(graph[node] & set(component)):
            if successor == start:
                return [*paths[node], start]
            if successor not in paths:
                paths[successor] = [*paths[node], successor]
                queue.append(successor)
    return component


def _cycles() -> dict[tuple[str, ...], str]:
    graph = import_graph()
    return {tuple(c): " -> ".join(_one_cycle(graph, c)) for c in _strongly_connected(graph)}


def test_the_import_graph_sees_module_level_function_level_and_relative_imports():
    deps = import_graph()
    assert "hydraddp.distributed.comp_models.base" in deps["hydraddp.distributed.utils"]  # module level
    assert "hydraddp.distributed.elastic" in deps["hydraddp.distributed.comp_models.native"]  # in a function
    assert "hydraddp.parallel.machine" in deps["hydraddp.distributed.launcher"]  # from package import module
    assert _strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _one_cycle({"a": {"b"}, "b": {"c", "a"}, "c": {"a"}}, ["a", "b", "c"]) == ["a", "b", "a"]


def test_no_module_imports_itself_through_others():
    """Dependencies point down only (DESIGN.md): a cycle means two modules each need a piece of the other, which
    belongs below both."""
    cycles = _cycles()
    unknown = [path for members, path in cycles.items() if members not in KNOWN_CYCLES]
    assert not unknown, "import cycles:\n" + "\n".join(unknown)


def test_known_cycles_still_exist():
    """An entry of ``KNOWN_CYCLES`` whose cycle is gone must go too, so that the cycle cannot come back unseen."""
    assert not KNOWN_CYCLES - set(_cycles()), f"remove from KNOWN_CYCLES: {sorted(KNOWN_CYCLES - set(_cycles()))}"


def _function_lengths() -> dict[str, int]:
    """Every function and method of the package, as "path:name", with its length in lines (decorators not counted).
    Two functions of one name in one module keep the longer one."""
    lengths: dict[str, int] = {}
    for module, path in _modules().items():
        for node in ast.walk(_tree(module)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                key = f"{path.relative_to(PACKAGE).as_posix()}:{node.name}"
                lengths[key] = max(lengths.get(key, 0), node.end_lineno - node.lineno + 1)
    return lengths


def test_no_function_is_over_60_lines():
    """A long function is several steps that deserve names; split it along its seams."""
    too_long = {name: lines for name, lines in _function_lengths().items()
                if lines > MAX_FUNCTION_LINES and name not in KNOWN_LONG_FUNCTIONS}
    assert not too_long, "\n".join(f"{name}: {lines} lines (at most {MAX_FUNCTION_LINES})"
                                   for name, lines in sorted(too_long.items(), key=lambda item: -item[1]))


def test_known_long_functions_are_still_long():
    lengths = _function_lengths()
    fixed = sorted(name for name in KNOWN_LONG_FUNCTIONS if lengths.get(name, 0) <= MAX_FUNCTION_LINES)
    assert not fixed, f"remove from KNOWN_LONG_FUNCTIONS: {fixed}"


def test_the_core_imports_nothing_of_hydra_omegaconf_or_mlflow():
    """``distributed/`` and ``parallel/`` are torch only (DESIGN.md), in every import, lazy ones included."""
    core = [m for m in _modules() if any(m == f"hydraddp.{c}" or m.startswith(f"hydraddp.{c}.") for c in CORE)]
    assert "hydraddp.distributed.utils" in core
    offenders = []
    for module in core:
        for node in _imports(module):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if not node.level else []
            offenders += [f"{module}:{node.lineno} imports {name}" for name in names
                          if name.split(".")[0] in FORBIDDEN_IN_CORE]
    assert not offenders, "\n".join(offenders)


# The layers, top to bottom (docs/architecture.md): a module may import its own layer and those below it, never one
# above. Every module of the package is in one (test_every_module_has_a_layer).
LAYERS = [("hydraddp.__main__", "hydraddp.cli", "hydraddp.sweep", "hydraddp.launch", "hydraddp.export",
           "hydraddp.plan", "hydraddp.kube", "hydraddp.clusters", "hydraddp.demo", "hydraddp.compare",
           "hydraddp.search.sweeper", "hydraddp.search.launch", "hydraddp.search.parent_run",
           "hydraddp.search.report", "hydraddp.tracking.comparison", "hydraddp.tracking.sweep_parent",
           "hydraddp.tracking.sync"),
          # the judgement of a config, and a launch's MLflow run beside it
          ("hydraddp.job", "hydraddp.preflight", "hydraddp.config.compose", "hydraddp.config.schema",
           "hydraddp.config.overrides", "hydraddp.tracking.setup", "hydraddp.tracking.process",
           "hydraddp.tracking.run", "hydraddp.tracking.server",
           "hydraddp.tracking.node", "hydraddp.tracking.ui", "hydraddp.tracking.view",
           "hydraddp.tracking.logged_model", "hydraddp.tracking.system_metrics", "hydraddp.tracking.source",
           "hydraddp.tracking.inputs"),
          # what every rank runs, and what it tells the tracker
          ("hydraddp.build", "hydraddp.train", "hydraddp.search.space", "hydraddp.search.storage",
           "hydraddp.tracking.events", "hydraddp.tracking.per_rank", "hydraddp.tracking.client"),
          # what one process hands another, below every room that writes or reads it (the loop, the preflight, the
          # search, the commands): checkpoint roots, pretrained weights, preemption markers, a launch's result, a
          # search trial's spec and reports
          ("hydraddp.handoff",),
          ("hydraddp.models", "hydraddp.data", "hydraddp.config.instantiate"),
          ("hydraddp.distributed",),
          ("hydraddp.parallel",),
          # leaves every layer may use: they import nothing of the package
          ("hydraddp.exit_codes", "hydraddp.redaction", "hydraddp.lease", "hydraddp.forked", "hydraddp.tracking.names")]
# Package __init__ files that only name their package.
PACKAGES = ("hydraddp", "hydraddp.config", "hydraddp.data", "hydraddp.handoff", "hydraddp.search",
            "hydraddp.tracking")
MAX_MODULE_LINES = 400
# Modules another change is splitting, as paths, with the issue. None today.
KNOWN_LONG_MODULES: set[str] = set()


def _layer(module: str) -> int | None:
    for depth, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return depth
    return None


def test_no_module_imports_a_layer_above_its_own():
    """``parallel`` (how a model is spread) is below ``distributed`` (ignite's surface), which is below the model of a
    config (``models``), the build and the loop, the checks before a launch, and the commands."""
    graph = import_graph()
    assert _layer("hydraddp.parallel.parallelize") == len(LAYERS) - 2 and _layer("hydraddp.train.loop") == 2
    upward = sorted(f"{module} -> {dep}" for module, deps in graph.items() for dep in deps
                    if _layer(module) is not None and _layer(dep) is not None and _layer(dep) < _layer(module))
    assert not upward, "\n".join(upward)


def test_every_module_has_a_layer():
    """A new module is placed in the architecture when it is written, not found outside it later."""
    unplaced = sorted(m for m in _modules() if _layer(m) is None and m not in PACKAGES)
    assert not unplaced, "modules in no layer of LAYERS: " + ", ".join(unplaced)


# Rooms that never reach into one another, even where the layers would let them: what they share lies below all of
# them (``handoff``). The search's sweeper is a command, and asks the preflight like every command does.
SEPARATE_ROOMS = {"hydraddp.train": ("hydraddp.preflight", "hydraddp.search", "hydraddp.cli"),
                  "hydraddp.preflight": ("hydraddp.train", "hydraddp.search", "hydraddp.cli"),
                  "hydraddp.search": ("hydraddp.train", "hydraddp.cli"),
                  "hydraddp.sweep": ("hydraddp.cli",)}


def test_the_loop_the_preflight_and_the_search_share_only_what_lies_below_them():
    """The loop never depends on the search plugin, the search never on the command line, and the judge of a config
    never on the loop's room: a change to one room cannot break another."""
    def within(module: str, room: str) -> bool:
        return module == room or module.startswith(room + ".")

    reaching = sorted(f"{module} -> {dep}" for module, deps in import_graph().items() for dep in deps
                      for room, others in SEPARATE_ROOMS.items() if within(module, room)
                      and any(within(dep, other) for other in others))
    assert not reaching, "\n".join(reaching)


def _module_lengths() -> dict[str, int]:
    return {path.relative_to(PACKAGE.parent).as_posix(): len(path.read_text().splitlines())
            for path in _modules().values()}


def test_no_module_is_over_400_lines():
    """A long module holds more than one job: split it along its seams."""
    too_long = {path: lines for path, lines in _module_lengths().items()
                if lines > MAX_MODULE_LINES and path not in KNOWN_LONG_MODULES}
    assert not too_long, "\n".join(f"{path}: {lines} lines (at most {MAX_MODULE_LINES})"
                                   for path, lines in sorted(too_long.items()))


def test_known_long_modules_are_still_long():
    lengths = _module_lengths()
    fixed = sorted(path for path in KNOWN_LONG_MODULES if lengths.get(path, 0) <= MAX_MODULE_LINES)
    assert not fixed, f"remove from KNOWN_LONG_MODULES: {fixed}"
