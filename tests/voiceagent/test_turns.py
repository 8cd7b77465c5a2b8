"""Turn strategies chosen from the config (no pipeline)."""

from pipecat.turns.user_start import MinWordsUserTurnStartStrategy
from pipecat.turns.user_stop import SpeechTimeoutUserTurnStopStrategy

from voiceagent.config import TurnConfig
from voiceagent.pipeline.turns import (
    PreparingSmartTurnStopStrategy,
    PreparingSpeechTimeoutStopStrategy,
    SustainedSpeechUserTurnStartStrategy,
    turn_strategies,
)


def test_preparation_wraps_the_configured_stop_strategy():
    [vad] = turn_strategies(TurnConfig(prepare=True)).stop
    assert isinstance(vad, PreparingSpeechTimeoutStopStrategy)
    [plain] = turn_strategies(TurnConfig(prepare=False)).stop
    assert type(plain) is SpeechTimeoutUserTurnStopStrategy
    [smart] = turn_strategies(TurnConfig(prepare=True, stop="smart_turn")).stop
    assert isinstance(smart, PreparingSmartTurnStopStrategy)


def test_smart_turn_calls_share_the_model_but_not_the_audio():
    [a] = turn_strategies(TurnConfig(stop="smart_turn")).stop
    [b] = turn_strategies(TurnConfig(stop="smart_turn")).stop
    assert a._turn_analyzer is not b._turn_analyzer
    assert a._turn_analyzer._session is b._turn_analyzer._session
    assert a._turn_analyzer._audio_buffer is not b._turn_analyzer._audio_buffer


def test_backchannel_limits_replace_the_vad_start():
    kinds = [type(s) for s in turn_strategies(
        TurnConfig(min_interrupt_s=0.6, min_interrupt_words=3)).start]
    assert kinds == [SustainedSpeechUserTurnStartStrategy, MinWordsUserTurnStartStrategy]
