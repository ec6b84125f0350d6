"""A rank's glibc heap keeps a step's freed buffers mapped, whatever the process freed before (host_heap.settle).

Each case runs in a fresh interpreter: malloc's thresholds are process-wide and only move one way. The probe asks
glibc itself (``mallinfo2``) where a 16 MiB buffer came from and what a step's freed 48 MiB left behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "confstr") or not os.confstr("CS_GNU_LIBC_VERSION"),
                                reason="glibc's malloc only")

PROBE = r"""
import ctypes, json, sys
from hydraddp.train import host_heap

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
settled = host_heap.settle()
MiB = 1 << 20
# A step: three 16 MiB buffers (FSDP2's gathered parameters, its gradients, ...), each touched, then all freed.
buffers = [libc.malloc(16 * MiB) for _ in range(3)]
for buffer in buffers:
    ctypes.memset(buffer, 1, 16 * MiB)
during = libc.mallinfo2()
for buffer in reversed(buffers):
    libc.free(buffer)
after = libc.mallinfo2()
print(json.dumps({"settled": settled, "mmapped_during": during.hblkhd, "heap_during": during.arena,
                  "heap_after": after.arena}))
"""


def probe(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_steps_freed_buffers_stay_in_the_heap_for_the_next_step():
    heap = probe()
    assert heap["settled"] == "glibc malloc: mmap threshold 32 MiB, trim threshold 64 MiB"
    # 16 MiB is under the 32 MiB mmap threshold: the buffers come from the heap, not from mmap (which unmaps on free)...
    assert heap["mmapped_during"] < 16 << 20
    assert heap["heap_during"] >= 48 << 20
    # ...and freeing 48 MiB, under the 64 MiB trim threshold, gives nothing back: the next step faults nothing in.
    assert heap["heap_after"] == heap["heap_during"]


def test_a_fresh_process_would_unmap_them_and_the_users_own_malloc_settings_are_kept():
    """The default the setting replaces (a fresh process's 128 KiB threshold mmaps each buffer and unmaps it on
    free), and a user's own setting, which settle leaves alone."""
    heap = probe(MALLOC_TRIM_THRESHOLD_=str(128 << 10))
    assert heap["settled"] is None
    assert heap["mmapped_during"] >= 48 << 20
    heap = probe(GLIBC_TUNABLES="glibc.malloc.mmap_threshold=131072")
    assert heap["settled"] is None and heap["mmapped_during"] >= 48 << 20
