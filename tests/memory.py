"""Memory as the tests read it: what a process holds once its garbage is collected and glibc has
returned its free pages, not what an allocator merely keeps for reuse."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

from voiceagent.bench.serve import rss_mb

LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
                .split()]


HAS_MALLINFO2 = hasattr(LIBC, "mallinfo2")  # glibc 2.33 and later
if HAS_MALLINFO2:
    LIBC.mallinfo2.restype = _MallInfo2


def settled_memory() -> tuple[float, float]:
    """RSS, and the bytes malloc has handed out and not had back (MB; 0 without mallinfo2),
    after `gc.collect()` and `malloc_trim(0)`. The second is exact where RSS wanders by ~10 MB
    from call to call."""
    gc.collect()
    LIBC.malloc_trim(0)
    if not HAS_MALLINFO2:
        return rss_mb(), 0.0
    info = LIBC.mallinfo2()
    return rss_mb(), (info.uordblks + info.hblkhd) / 2**20
