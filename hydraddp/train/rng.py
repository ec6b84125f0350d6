"""A process's RNG states (torch, CUDA, NumPy, Python) as JSON, and back: for checkpoints, and for the data
loader's workers (``data.WorkerRng``). Literals only: restoring runs no code. And the seeds of a data-parallel
rank's own streams (``stream_seed``, ``seed_rank``)."""

from __future__ import annotations

import ast
import base64
import random
from typing import Any

import torch


def state(cuda: bool = True) -> dict[str, Any]:
    """This process's RNG states; ``cuda=False`` in a loader worker, which must not initialize CUDA."""
    import numpy as np

    encode = lambda t: base64.b64encode(t.numpy().tobytes()).decode()  # noqa: E731
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    saved = {"torch": encode(torch.get_rng_state()), "python": repr(random.getstate()),
             "numpy": {"kind": kind, "keys": base64.b64encode(keys.tobytes()).decode(), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}}
    if cuda and torch.cuda.is_available():
        saved["cuda"] = [encode(s) for s in torch.cuda.get_rng_state_all()]
    return saved


def restore(saved: dict[str, Any] | None) -> None:
    """Set this process's RNGs as ``state`` saved them. In the loop: once the data loader's iterator exists, right
    before the first step (nothing may draw in between)."""
    import numpy as np

    if saved is None:
        return
    decode = lambda s: torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)  # noqa: E731
    torch.set_rng_state(decode(saved["torch"]))
    random.setstate(ast.literal_eval(saved["python"]))
    if "numpy" in saved:
        numpy_state = saved["numpy"]
        keys = np.frombuffer(base64.b64decode(numpy_state["keys"]), dtype=np.uint32)
        np.random.set_state((numpy_state["kind"], keys, numpy_state["pos"], numpy_state["has_gauss"],
                             numpy_state["cached_gaussian"]))
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([decode(s) for s in saved["cuda"]])


def stream_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed of its own for each ``(seed, *keys)``: NumPy's ``SeedSequence`` mixes them, so nearby keys (rank
    0 and 1, epoch 3 and 4) give unrelated streams, where ``seed + rank`` would let rank 1's epoch 0 be rank 0's
    epoch 1."""
    import numpy as np

    high, low = np.random.SeedSequence([seed, *keys]).generate_state(2, np.uint32)
    return (int(high) << 31) ^ int(low)


def seed_rank(seed: int, data_rank: int, step: int) -> None:
    """Seed this process's RNGs (torch on every device, NumPy, Python) for training from ``step`` as data-parallel rank
    ``data_rank``: each replica draws its own dropout masks (the same noise on every replica would be correlated
    across the global batch), while the ranks of one TP group, which share ``data_rank``, draw the same ones, as a
    replicated activation needs. The model is built before this, under ``seed`` alone, identical on every rank. A
    resume at the same world size then restores the saved states over these (``restore``)."""
    import numpy as np

    torch.manual_seed(stream_seed(seed, data_rank, step))
    np.random.seed(stream_seed(seed, data_rank, step, 1) % 2**32)
    random.seed(stream_seed(seed, data_rank, step, 2))
