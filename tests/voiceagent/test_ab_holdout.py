"""The A/B baseline: `serve` holds out `server.ab_off_share` of its calls with speculation off."""

import pytest

from tests.voiceagent.serving import server_config
from tests.voiceagent.tiny_shared import tiny_shared
from voiceagent.server.ab import OffHoldout
from voiceagent.server.calls import ActiveCall
from voiceagent.server.state import new_state


@pytest.mark.parametrize("share", [0.0, 0.1, 0.25, 0.3, 0.7, 1.0])
def test_every_run_of_calls_holds_out_the_share_asked_for(share):
    holdout = OffHoldout(share)
    picks = [holdout.next_is_off() for _ in range(200)]
    assert sum(picks) == round(200 * share)
    for start in range(0, 190, 7):  # any 10 calls in a row: the share, to within one
        assert abs(sum(picks[start:start + 10]) - 10 * share) <= 1


def test_a_share_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        OffHoldout(1.5)


def test_held_out_calls_run_and_are_stored_with_speculation_off(tmp_path):
    state = new_state(server_config(tmp_path, "server.ab_off_share=0.5",
                                    "engine.speculation.method=ngram"), tiny_shared("ngram"))
    try:
        methods = [state.call_method() for _ in range(4)]
        assert methods == ["ngram", "off", "ngram", "off"]
        call = ActiveCall("held", "twilio", method=methods[1])
        state.on_call("started", call)
        state.store.flush()
        assert state.store.call("held")["call"]["method"] == "off"
    finally:
        state.shared.close()
        state.store.close()


def test_no_call_is_held_out_when_the_share_is_zero(tmp_path):
    state = new_state(server_config(tmp_path, "server.ab_off_share=0",
                                    "engine.speculation.method=ngram"), tiny_shared("ngram"))
    try:
        assert {state.call_method() for _ in range(20)} == {"ngram"}
    finally:
        state.shared.close()
        state.store.close()
