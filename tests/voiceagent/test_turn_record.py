"""The turn record's engine stats are typed (`TurnStats`); records stored before still load."""

from __future__ import annotations

import json

from tests.voiceagent.turns import make_turn
from voiceagent.pipeline.turn_record import TurnRecord, TurnStats

# A record as an older version stored it: the engine stats with their derived figures, a step
# field and a top-level key this version does not know, no `error`.
OLD = {
    "call_id": "c1", "turn": 2, "started_at": 1000.0, "user_text": "hi", "bot_text": "hello",
    "llm_text": "hello", "interrupted": False, "retired_field": 1,
    "clocks": {"request_to_first_token_ms": 90.0},
    "engine": {"method": "ngram", "request_id": "r7", "interrupted": False,
               "itl_ms": [0.0, 30.0], "token_times_ms": [90.0, 90.0, 120.0],
               "steps": [{"k": 2, "drafted": 2, "accepted": 1, "rejection_pos": 1,
                          "committed": 2, "draft_ms": 0.3, "verify_ms": 20.0, "old_key": 0}],
               "drafted": 2, "accepted": 1, "tokens_per_s": 66.7, "acceptance_rate": 0.5},
}


def test_an_older_stored_record_loads_with_typed_engine_stats():
    record = TurnRecord.from_dict(OLD)
    assert isinstance(record.engine, TurnStats)
    assert (record.engine.request_id, record.engine.error) == ("r7", None)
    assert record.engine.steps[0].accepted == 1 and record.engine.acceptance_rate == 0.5
    assert record.method == "ngram"


def test_a_record_without_engine_stats_loads_as_none_and_stores_as_an_empty_object():
    record = TurnRecord.from_dict({**OLD, "engine": {}})
    assert record.engine is None and record.method == "unknown"
    assert record.to_dict()["engine"] == {}


def test_a_record_round_trips_through_json_with_its_derived_figures():
    record = make_turn("c1", 1)
    data = json.loads(json.dumps(record.to_dict()))
    assert data["engine"]["drafted"] == record.engine.drafted
    assert data["engine"]["tokens_per_s"] == record.engine.tokens_per_s
    assert TurnRecord.from_dict(data) == record
