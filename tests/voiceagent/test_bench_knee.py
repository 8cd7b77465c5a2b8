"""`bench serve --knee`: the knee is the most calls the server ran at once that kept their
conversations within the threshold; refused callers count neither against it nor as served."""

from __future__ import annotations

import numpy as np

from tests.audio.speech import speech
from tests.voiceagent.serving import server_config, serving, twilio_url
from tests.voiceagent.turns import make_turn
from voiceagent.bench.callers import call_from_another_process
from voiceagent.bench.knee import knee_of, level, render_knee, variants


def _level(n: int, within: int, refused: int = 0, failed: int = 0) -> dict:
    admitted = n - refused
    return {"method": "ngram", "callers": n, "admitted": admitted, "served": admitted,
            "refused": refused, "failed": failed, "within": within, "clock3_p50_ms": 1.0,
            "clock3_p95_ms": 1.0, "itl_p95_ms": 1.0}


def test_the_knee_is_the_most_calls_served_at_once_within_the_threshold():
    levels = [_level(1, 1), _level(2, 2), _level(3, 2), _level(4, 2, refused=1)]
    assert knee_of(levels) == 2  # 3 callers: 2 of 3 within; 4: 2 of the 3 admitted
    assert knee_of([*levels[:3], _level(4, 3, refused=1)]) == 3  # 3 admitted, all within
    assert knee_of([_level(1, 0)]) == 0
    assert knee_of([_level(1, 1), _level(2, 2, failed=1)]) == 1  # a failed call is never ok


def test_a_level_counts_a_conversation_within_only_if_every_turn_is():
    fast, slow = make_turn("a", 1, clock3_ms=900.0), make_turn("b", 1, clock3_ms=1600.0)
    got = level("off", 3, ["done", "done", "refused"], [[fast], [fast, slow]], 1500.0)
    assert (got["admitted"], got["refused"], got["within"]) == (2, 1, 1)
    assert "| off | 3 | 2 | 1 | 0 |" in render_knee(
        {"threshold_ms": 1500.0, "max_calls": 2, "turns": 2, "levels": [got],
         "knee": {"off": 0}})


def test_a_level_over_several_passes_pools_their_turns_and_counts_each_conversation():
    fast, slow = make_turn("a", 1, clock3_ms=900.0), make_turn("b", 1, clock3_ms=1600.0)
    # two passes of 2 callers: the second refused one caller; 2 of the 3 served stayed within
    got = level("off", 2, ["done", "done", "done", "refused"], [[fast], [slow], [fast]], 1500.0)
    assert (got["admitted"], got["served"], got["within"]) == (1, 3, 2)
    assert got["clock3_p50_ms"] == 900.0  # over the three turns of both passes
    assert knee_of([got]) == 0  # 2 of 3 is under 90%
    assert knee_of([{**got, "within": 3}]) == 1
    table = render_knee({"threshold_ms": 1500.0, "max_calls": 2, "turns": 1, "passes": 2,
                         "levels": [got], "knee": {"off": 0}})
    assert "| off | 2 | 1 | 1 | 0 |" in table and "| 2/3 |" in table
    assert "ran 2 times" in table
    # three passes of 3: the first refused 2, the others none: at once, 1 was admitted
    spread = level("off", 3, ["refused", "refused", "done"] + ["done"] * 6, [[fast]] * 7, 1500.0)
    assert (spread["admitted"], spread["refused"], spread["served"]) == (1, 2, 7)


def test_comparing_shared_forwards_runs_each_method_both_ways():
    assert variants(["off", "ngram"], False) == [("off", "off", True), ("ngram", "ngram", True)]
    assert variants(["off"], True) == [("off (forward each)", "off", False),
                                       ("off (shared forward)", "off", True)]


def test_a_level_shows_each_stages_median_over_its_turns():
    turns = [make_turn("a", 1), make_turn("b", 1)]
    turns[1].breakdown.asr_final_ms = 350.0  # a final that waited behind another caller's
    got = level("off", 2, ["done", "done"], [[turns[0]], [turns[1]]], 1500.0)
    assert got["breakdown_p50_ms"]["asr_final_ms"] == 250.0  # (150 + 350) / 2
    assert got["breakdown_p50_ms"]["prefill_ms"] == 90.0
    table = render_knee({"threshold_ms": 1500.0, "max_calls": 2, "turns": 1, "levels": [got],
                         "knee": {"off": 2}})
    assert "| off | 2 | 300 | 250 |" in table  # hangover, then the ASR final


async def test_the_callers_process_holds_a_conversation_with_the_server(tmp_path, models):
    clip = tmp_path / "0.npy"
    np.save(clip, speech("What is the capital of France?"))
    async with serving(server_config(tmp_path), models) as (app, base):
        outcomes = await call_from_another_process(twilio_url(base), [clip], 1, 0)
        await app.state.server.calls.wait_idle()
        [turns] = app.state.server.records.by_call.values()
    assert outcomes == ["done"]
    assert turns[0].user_text.startswith("What is the capital")
