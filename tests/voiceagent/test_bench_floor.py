"""The per-stage floor of `bench call`: each stage measured alone with the real embedded models."""

import pytest

from voiceagent.bench.floor import STAGES, measure_floor, render_floor
from voiceagent.config import load_config


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return load_config(None, [f"paths.runs_dir={tmp_path_factory.mktemp('runs')}",
                              "vad.stop_secs=0.3"])


async def test_every_stage_is_measured_alone(cfg, models):
    floor = await measure_floor(cfg, models, ["What is the capital of France?"])
    assert floor["vad_hangover_ms"] == 300
    for key, _name in STAGES:
        assert floor[key] is not None and floor[key] > 0, key


def test_the_floor_table_sets_each_stage_beside_its_p50_in_the_calls():
    floor = {key: 10.0 * (i + 1) for i, (key, _) in enumerate(STAGES)}
    summary = {"ngram+prepare": {"breakdown_p50_ms": {key: 100.0 for key, _ in STAGES}}}
    table = render_floor(floor, summary)
    assert "| hangover | 10 | 100 |" in table
    assert "| TTS first chunk | 50 | 100 |" in table
