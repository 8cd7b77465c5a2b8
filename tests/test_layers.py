"""The layer table of docs/ARCHITECTURE.md, enforced: every import between our packages, including
those inside functions, must be an arrow the table allows."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUB = ("pipeline", "dashboard", "server", "commands", "sim", "bench")

# What each layer may import of ours. `voiceagent` is the package's own top level (config, models,
# figures, logs, prompt sets, tools, drafts); `voiceagent/cli.py`, the entry point, dispatches to
# every command and is the one module outside the table.
ALLOWED = {
    "llm_engine": set(),
    "audio": set(),
    "voiceagent": {"llm_engine", "audio"},
    "pipeline": {"llm_engine", "audio", "voiceagent"},
    "dashboard": {"llm_engine", "audio", "voiceagent", "pipeline"},
    "server": {"llm_engine", "audio", "voiceagent", "pipeline", "dashboard"},
    "commands": {"llm_engine", "audio", "voiceagent", "pipeline", "dashboard", "sim"},
    "sim": {"audio", "voiceagent", "pipeline"},
    "bench": {"llm_engine", "audio", "voiceagent", "pipeline", "dashboard", "server", "sim"},
}
THIRD_PARTY_FORBIDDEN = {"llm_engine": {"pipecat", "audio"}, "audio": {"pipecat", "torch"}}
EXEMPT = {"voiceagent/cli.py"}


def layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] in ("llm_engine", "audio"):
        return parts[0]
    if parts[0] != "voiceagent":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in SUB else "voiceagent"


def imports(source: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def file_violations(rel: str, source: str) -> list[str]:
    """The imports of the file at `rel` (relative to the repository) that the table forbids."""
    if rel in EXEMPT:
        return []
    src = layer(".".join(Path(rel).with_suffix("").parts))
    bad = []
    for line, module in imports(source):
        dst = layer(module)
        if dst is not None and dst != src and dst not in ALLOWED[src]:
            bad.append(f"{rel}:{line} ({src}) imports {module} ({dst})")
        elif dst is None and module.split(".")[0] in THIRD_PARTY_FORBIDDEN.get(src, ()):
            bad.append(f"{rel}:{line} ({src}) imports {module}")
    return bad


def test_every_import_between_packages_is_an_arrow_the_layer_table_allows():
    files = sorted(f for pkg in ("llm_engine", "audio", "voiceagent")
                   for f in (ROOT / pkg).rglob("*.py"))
    assert len(files) > 100
    bad = [v for f in files for v in file_violations(f.relative_to(ROOT).as_posix(), f.read_text())]
    assert bad == []


@pytest.mark.parametrize("rel, source", [
    ("voiceagent/pipeline/x.py", "from voiceagent.server.app import create_app"),
    ("voiceagent/sim/x.py", "def f():\n    from voiceagent.dashboard.store import open_store"),
    ("llm_engine/x.py", "import voiceagent.config"),
    ("llm_engine/x.py", "from pipecat.frames.frames import Frame"),
    ("voiceagent/llm_setup.py", "from voiceagent.bench.engine import run"),
])
def test_the_check_finds_a_forbidden_arrow_anywhere_in_a_file(rel, source):
    assert len(file_violations(rel, source)) == 1


def test_the_check_allows_an_arrow_the_table_has():
    assert file_violations("voiceagent/server/x.py", "from voiceagent.pipeline import clocks") == []
