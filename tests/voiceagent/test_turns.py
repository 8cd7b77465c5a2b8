"""Turn strategies chosen from the config (no pipeline)."""

import pytest
from pipecat.turns.user_start import MinWordsUserTurnStartStrategy

from voiceagent.config import TurnConfig
from voiceagent.pipeline.turns import (
    HoldingSpeechTimeoutStopStrategy,
    PreparingSmartTurnStopStrategy,
    PreparingSpeechTimeoutStopStrategy,
    SustainedSpeechUserTurnStartStrategy,
    load_smart_turn_session,
    turn_strategies,
)


@pytest.fixture(scope="module")
def smart_turn():
    return load_smart_turn_session()


def test_preparation_wraps_the_configured_stop_strategy(smart_turn):
    [vad] = turn_strategies(TurnConfig(prepare=True)).stop
    assert isinstance(vad, PreparingSpeechTimeoutStopStrategy)
    [plain] = turn_strategies(TurnConfig(prepare=False)).stop
    assert type(plain) is HoldingSpeechTimeoutStopStrategy
    [smart] = turn_strategies(TurnConfig(prepare=True, stop="smart_turn"), smart_turn).stop
    assert isinstance(smart, PreparingSmartTurnStopStrategy)


def test_smart_turn_calls_share_the_model_but_not_the_audio(smart_turn):
    [a] = turn_strategies(TurnConfig(stop="smart_turn"), smart_turn).stop
    [b] = turn_strategies(TurnConfig(stop="smart_turn"), smart_turn).stop
    assert a._turn_analyzer is not b._turn_analyzer
    assert a._turn_analyzer._session is b._turn_analyzer._session is smart_turn
    assert a._turn_analyzer._audio_buffer is not b._turn_analyzer._audio_buffer


def test_backchannel_limits_replace_the_vad_start():
    kinds = [type(s) for s in turn_strategies(
        TurnConfig(min_interrupt_s=0.6, min_interrupt_words=3)).start]
    assert kinds == [SustainedSpeechUserTurnStartStrategy, MinWordsUserTurnStartStrategy]


def test_smart_turn_without_its_model_is_refused_by_name():
    with pytest.raises(ValueError, match="no Smart Turn model is loaded"):
        turn_strategies(TurnConfig(stop="smart_turn"))
