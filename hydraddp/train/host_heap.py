"""Keep a rank's C heap from shrinking and growing back at every step (glibc only).

glibc serves an allocation above its mmap threshold (128 KiB at first) with ``mmap`` and unmaps it on free. Freeing
such a chunk raises the threshold to its size, up to 32 MiB, and the heap's free top is returned to the kernel once
it passes twice the threshold. So where a rank's thresholds stand, and whether a step's buffers (FSDP2's gathered
parameters and gradients, the activations) are unmapped or trimmed after every step and faulted back in at the next,
depends on which chunks the process happened to free before training. hydraddp's fsdp2 ranks on the benchmark MLP
faulted about 3,700 pages a step against the plain script's 1,000, same model, same step (``/usr/bin/time %R``,
330 steps minus 130), and under gVisor each fault is microseconds: most of fsdp2's gap to the plain script.

``settle()`` sets both thresholds where glibc's own rule ends (32 MiB, and twice that), so a rank's steady state no
longer depends on its history. The cost: up to 64 MiB of freed heap may stay resident per process. A user who tunes
malloc (``MALLOC_*_`` variables, ``GLIBC_TUNABLES``) keeps their settings.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: the highest the dynamic threshold goes
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # what glibc sets beside it when it raises the threshold
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def settle() -> str | None:
    """Fix this process's glibc malloc thresholds. Returns what was set, or None where nothing was (not glibc, or the
    user's own malloc settings)."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
    except (ValueError, OSError):  # no such name: not glibc (musl, macOS)
        return None
    if any(name in os.environ for name in USER_SETTINGS) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return None
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return None
    return f"glibc malloc: mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB"
