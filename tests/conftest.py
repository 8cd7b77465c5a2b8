"""Tests run offline: no hub access, ever."""

import os
from collections import Counter

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest  # noqa: E402

from voiceagent.malloc import ARENAS, cap_arenas  # noqa: E402

# The servers under test run in the test processes, capped as `voiceagent serve` caps. Capped
# this late (pytest already runs), RSS still wandered ±20 MB over the soak; capped at start-up it
# stays flat, so xdist's workers (the README's command) start with glibc's own variable.
cap_arenas()
os.environ.setdefault("MALLOC_ARENA_MAX", str(ARENAS))

# The modules that take a worker a minute or more (`--durations`), longest first. xdist hands
# modules out in collection order (`--no-loadscope-reorder` in the addopts), so these start first
# and the short ones fill in beside them: started last, the 5-minute soak ran alone at the end.
LONG_MODULES = [
    "tests/voiceagent/test_server_soak.py",
    "tests/voiceagent/test_faults_under_load.py",
    "tests/voiceagent/test_preparation.py",
    "tests/voiceagent/test_call.py",
    "tests/llm_engine/test_trained_draft.py",
    "tests/voiceagent/test_server_lifecycle.py",
    "tests/llm_engine/test_lean_gguf.py",
    "tests/llm_engine/test_loading.py",
    "tests/voiceagent/test_browser_dashboard.py",
]


def pytest_collection_modifyitems(items):
    """Every test has its own node id: pytest-xdist's per-module scheduling (the README's test
    command) keys tests by it, and of several that share one it would run one. The long modules
    go first (`LONG_MODULES`); the rest keep their order."""
    counts = Counter(item.nodeid for item in items)
    shared = sorted(nodeid for nodeid, n in counts.items() if n > 1)
    if shared:
        raise pytest.UsageError(f"tests that share a node id: {shared}")

    def rank(item) -> int:
        module = item.nodeid.split("::", 1)[0]
        return LONG_MODULES.index(module) if module in LONG_MODULES else len(LONG_MODULES)

    items.sort(key=rank)


@pytest.fixture(autouse=True)
def _no_secrets_from_the_environment(monkeypatch):
    """A developer's exported settings (VOICEAGENT_TOKEN, TWILIO_AUTH_TOKEN, VOICEAGENT_..__..)
    must not change what the tests' servers do (tests that need one set it themselves)."""
    for name in list(os.environ):
        if name in ("VOICEAGENT_TOKEN", "TWILIO_AUTH_TOKEN") or (
                name.startswith("VOICEAGENT_") and "__" in name):  # any config key
            monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct target, loaded once (de-quantised cache reused)."""
    from voiceagent.config import load_config
    from voiceagent.llm_setup import load_llm

    cfg = load_config()
    return load_llm(cfg.engine.target, cfg.engine, cfg.paths.cache_dir, progress=lambda _: None)


@pytest.fixture(scope="session")
def smollm2_costs(smollm2):
    """One cost model for the embedded target's test engines: measuring takes ~4 s an engine,
    and what an engine says does not depend on it (only how long its drafts are)."""
    from llm_engine.config import EngineConfig
    from llm_engine.engine import SpeculativeEngine

    return SpeculativeEngine(smollm2.model, smollm2.tokenizer, EngineConfig(),
                             draft_model=smollm2.model).cost_model
