"""The process keeps to glibc's two arenas however many threads allocate at once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.memory import LIBC

# Eight threads allocating at once, then glibc's own account of its heaps (`malloc_info`).
SCRIPT = """
import ctypes, sys, threading
from voiceagent.malloc import cap_arenas
capped = cap_arenas()
barrier = threading.Barrier(8)
def work():
    barrier.wait()
    for _ in range(2000):
        bytearray(4096 * 64)
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
libc = ctypes.CDLL("libc.so.6")
libc.fopen.restype = ctypes.c_void_p
out = libc.fopen(sys.argv[1].encode(), b"w")
libc.malloc_info(0, ctypes.c_void_p(out))
libc.fclose(ctypes.c_void_p(out))
print(capped)
"""


def _heaps(tmp_path, env: dict) -> tuple[str, int]:
    path = tmp_path / "malloc.xml"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], env=env, check=True,
                          capture_output=True, text=True)
    return done.stdout.strip(), path.read_text().count("<heap nr=")


@pytest.mark.skipif(not hasattr(LIBC, "malloc_info"), reason="needs glibc")
def test_threads_share_two_arenas_unless_the_environment_says(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    capped, heaps = _heaps(tmp_path, env)
    assert capped == "True" and heaps <= 2
    capped, heaps = _heaps(tmp_path, {**env, "MALLOC_ARENA_MAX": "1"})
    assert capped == "False" and heaps == 1

