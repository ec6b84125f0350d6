"""Subprocess side of tests/helpers/spawn.py: run a target through hydraddp's Parallel and save what came back."""

import importlib
import sys

import torch

from hydraddp.distributed import Parallel, WorkerFailedError


def main(payload_path: str, result_path: str) -> None:
    payload = torch.load(payload_path, weights_only=False)
    module, name = payload["target"].split(":")
    fn = getattr(importlib.import_module(module), name)
    if payload["backend"] in (None, "none"):
        parallel = Parallel()  # one process: ignite's Parallel takes no sizes without a backend
    else:
        parallel = Parallel(backend=payload["backend"], nproc_per_node=payload["nproc"], **payload["kwargs"])
    try:
        outcome = {"results": parallel.run(fn, *payload["args"])}
    except WorkerFailedError as exc:
        outcome = {"failure": {"rank": exc.rank, "error": exc.error, "exitcode": exc.exitcode, "message": str(exc),
                               "traceback": exc.traceback}}
    torch.save(outcome, result_path)


if __name__ == "__main__":
    from hydraddp.exit_codes import exit_without_teardown

    exit_without_teardown(lambda: main(sys.argv[1], sys.argv[2]))  # as hydraddp's own commands end
