"""The sha256 of a weights file, remembered in `<cache_dir>/sha256-index.json` by (path, size,
mtime), so a multi-GB file hashes once. Several processes may start at once (test workers, a
rolling restart): the index is read leniently and replaced atomically."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from contextlib import nullcontext
from pathlib import Path

_known: dict[str, str] = {}  # this process's hashes, by the index key


def file_sha256(path: Path, cache_dir: str | Path | None = None, bar=None) -> str:
    """`bar(total)`, if given, makes a context with `update(n)` that shows the hashing."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    if key in _known:
        return _known[key]
    index = Path(cache_dir).expanduser() / "sha256-index.json" if cache_dir else None
    known = _read_index(index)
    if key not in known:
        known[key] = _hash(path, bar(st.st_size) if bar else nullcontext())
        _write_index(index, known)
    _known[key] = known[key]
    return known[key]


def _hash(path: Path, bar) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f, bar as shown:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
            if shown is not None:
                shown.update(len(block))
    return h.hexdigest()


def _read_index(index: Path | None) -> dict[str, str]:
    if index is None:
        return {}
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        return {}  # none yet, unreadable or corrupt: hash again
    return known if isinstance(known, dict) else {}


def _write_index(index: Path | None, known: dict[str, str]) -> None:
    """Atomically; an index that cannot be written only costs a hash next time."""
    if index is None:
        return
    try:
        index.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=index.parent, prefix=".sha256-index.")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(known, f, indent=1)
        os.replace(tmp, index)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
