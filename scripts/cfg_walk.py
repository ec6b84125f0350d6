"""The config's path through the code: every hydraddp function a launch's composed config (an OmegaConf node) is
handed to, from ``cli.run`` on, in the launching process, in call order.

    .venv/bin/python scripts/cfg_walk.py [overrides]      # prints the stays, then: N stays in F files, C climbs

A *stay* is a function that receives the config or a node of it as an argument; a *climb* is a stay in a higher
layer (tests/test_architecture.py's LAYERS) than the stay before it: the path went down, then came back up. The
workers receive the resolved config as a plain dict and are not counted.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.test_architecture import _layer  # noqa: E402


def main(overrides: list[str]) -> int:
    from omegaconf import Container

    import hydraddp

    package = str(Path(hydraddp.__file__).parent)
    stays: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    started = False

    def profile(frame, event, arg):
        nonlocal started
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(package):
            return
        module = frame.f_globals.get("__name__", "")
        if module == "hydraddp.cli" and code.co_name == "run":
            started = True
        if not started:
            return
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        if any(isinstance(frame.f_locals.get(name), Container) for name in names):
            stay = (module, code.co_name)
            stays.append(stay)
            seen.add(stay)

    sys.setprofile(profile)
    threading.setprofile(profile)
    import runpy

    from hydraddp import exit_codes

    exit_codes.exit_without_teardown = lambda main: main()  # return here instead of ending the process
    sys.argv = ["hydraddp", *overrides]
    try:
        runpy.run_module("hydraddp", run_name="__main__", alter_sys=True)  # as python -m hydraddp
    except SystemExit:
        pass
    finally:
        sys.setprofile(None)
    ordered = list(dict.fromkeys(stays))
    climbs = sum(1 for (a, _), (b, _) in zip(stays, stays[1:])
                 if _layer(a) is not None and _layer(b) is not None and _layer(b) < _layer(a))
    for module, function in ordered:
        print(f"  {module}.{function}")
    files = {module for module, _ in ordered}
    print(f"{len(ordered)} stays in {len(files)} files, {climbs} climbs back up a layer", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
