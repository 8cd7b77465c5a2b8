"""glibc's malloc arenas: two for the process, not eight per core.

glibc gives each new thread that allocates an arena of its own, up to 8 per core, and each arena
keeps the pages freed in it, partly used, on its own. A call's work hops between the event loop,
the engine worker and the speech threads, so RSS wandered ±30 MB from call to call and sat ~70 MB
higher while the bytes in use stayed flat; with two arenas it stays within 1-2 MB after warm-up
(docs/BENCHMARKS.md, "Soak and memory"). `MALLOC_ARENA_MAX` in the environment wins: glibc read
it when the process started (`GLIBC_TUNABLES` does not count here: the cap overrides it).
"""

from __future__ import annotations

import ctypes
import os

ARENAS = 2
_M_ARENA_MAX = -8  # mallopt's parameter, from glibc's malloc.h


def cap_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's arenas before the models start their threads. False where the environment
    already chose, or the C library is not glibc."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols, the C library's among them
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    return bool(mallopt and getattr(libc, "gnu_get_libc_version", None)
                and mallopt(_M_ARENA_MAX, arenas))
