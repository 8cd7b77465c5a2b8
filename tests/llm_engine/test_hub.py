"""Hub ids without a network: given up in seconds with the fix, or loaded from the hub cache."""

import socket
import time
from pathlib import Path

import pytest
from huggingface_hub import constants

from llm_engine import hub
from llm_engine.hub import HubUnavailable, hub_location
from llm_engine.loading import load_causal_lm
from tests.llm_engine.hub_cache import cached_snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_a_hub_that_never_answers_is_given_up_in_seconds_with_the_fix(hub_cache, monkeypatch):
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts nothing, answers nothing
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setattr(hub, "_probed", {})
        t0 = time.monotonic()
        with pytest.raises(HubUnavailable) as err:
            hub_location("someone/big-model", "engine.target")
        assert time.monotonic() - t0 < hub.PROBE_TIMEOUT_S + 2
    msg = str(err.value)
    assert "'someone/big-model' is a hub id" in msg and "cannot be reached" in msg
    assert "hf download someone/big-model --local-dir DIR" in msg
    assert msg.endswith("set engine.target to DIR")


def test_an_offline_hub_id_in_the_cache_loads_from_its_snapshot(hub_cache, tokenizer, target):
    snapshot = cached_snapshot(hub_cache, "someone/tiny", commit="feedbeef")
    target.save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    m = load_causal_lm("someone/tiny", device="cpu", progress=lambda _: None)
    assert m.source == str(snapshot) and m.revision == "feedbeef"
