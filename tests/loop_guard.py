"""What the current thread runs of torch and xgrammar: the event loop must run neither."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import xgrammar

_FORBIDDEN_DIRS = tuple(str(Path(m.__file__).parent) for m in (torch, xgrammar))


def _forbidden(frame, event, arg) -> str | None:
    if event == "call" and frame.f_code.co_filename.startswith(_FORBIDDEN_DIRS):
        return f"{frame.f_code.co_filename}:{frame.f_code.co_name}"
    if event == "c_call":
        owner = type(getattr(arg, "__self__", None)).__module__
        module = getattr(arg, "__module__", None) or ""
        if module.startswith(("torch", "xgrammar")) or owner.startswith(("torch", "xgrammar")):
            return f"{module or owner}.{getattr(arg, '__qualname__', arg)}"
    return None


@contextmanager
def torch_calls_on_this_thread():
    """Yields a list that collects each torch or xgrammar function this thread calls."""
    hits: list[str] = []
    previous = sys.getprofile()

    def profile(frame, event, arg):
        if (hit := _forbidden(frame, event, arg)) is not None:
            hits.append(hit)

    sys.setprofile(profile)
    try:
        yield hits
    finally:
        sys.setprofile(previous)
