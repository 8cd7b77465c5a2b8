"""The clocks observer on scripted frame sequences (no models): what each clock measures."""

from pipecat.frames.frames import (
    BotStartedSpeakingFrame,
    BotStoppedSpeakingFrame,
    EagerEndOfTurnCancelFrame,
    InterruptionFrame,
    LLMContextFrame,
    LLMTextFrame,
    MetricsFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSTextFrame,
    UserStoppedSpeakingFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.observers.base_observer import FramePushed
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.llm_service import LLMService
from pipecat.services.tts_service import TTSService
from pipecat.transports.base_output import BaseOutputTransport
from pipecat.transports.base_transport import TransportParams

from voiceagent.pipeline.clocks import ClocksObserver
from voiceagent.pipeline.frames import PreparedResponseStartFrame
from voiceagent.pipeline.metrics import (
    ASRFinalMetricsData,
    EngineStatsMetricsData,
    HeldAudioMetricsData,
)
from voiceagent.pipeline.turn_record import Percentiles

MS = 1_000_000  # ns


class FakeTTS(TTSService):
    async def run_tts(self, text, context_id):
        yield None


LLM, TTS = LLMService(), FakeTTS(sample_rate=16000)
OUT, OTHER = BaseOutputTransport(TransportParams()), FrameProcessor()


async def push(obs, frame, at_ms, src=OTHER, dst=OTHER):
    await obs.on_push_frame(FramePushed(src, dst, frame, FrameDirection.DOWNSTREAM, at_ms * MS))


def engine_metrics(interrupted=False, itl=(50.0, 0.0, 60.0)):
    stats = {"itl_ms": list(itl), "prefill_ms": 80.0, "method": "ngram"}
    data = EngineStatsMetricsData(
        processor="llm", request_id="r1", interrupted=interrupted,
        finish_reason="cancelled" if interrupted else "eos", stats=stats,
    )
    return MetricsFrame(data=[data])


async def answered_turn(obs, t0=0):
    await push(obs, VADUserStartedSpeakingFrame(), t0)
    # speech ended at t0+1000; the VAD confirmed it 500 ms later
    await push(obs, VADUserStoppedSpeakingFrame(stop_secs=0.5), t0 + 1500)
    await push(obs, MetricsFrame(data=[ASRFinalMetricsData(
        processor="stt", final_ms=5.0, audio_ms=1500, reused_interim=True)]), t0 + 1505)
    await push(obs, TranscriptionFrame("what time is it", "user", "now"), t0 + 1505)
    await push(obs, LLMContextFrame(LLMContext()), t0 + 1510, dst=LLM)
    await push(obs, LLMTextFrame("It is"), t0 + 1610, src=LLM)
    await push(obs, TTSStartedFrame(), t0 + 1700, src=TTS)
    await push(obs, TTSAudioRawFrame(b"\0\0" * 160, 16000, 1), t0 + 1900, src=TTS)
    await push(obs, BotStartedSpeakingFrame(), t0 + 1910, src=OUT)
    await push(obs, TTSTextFrame("It", text_type="word"), t0 + 1920, src=OUT)


async def test_answered_turn_has_the_three_clocks_and_breakdown():
    records = []
    obs = ClocksObserver("call-1", records.append)
    await answered_turn(obs)
    await push(obs, engine_metrics(), 2000)
    await push(obs, BotStoppedSpeakingFrame(), 2500, src=OUT)
    [r] = records
    assert r.user_text == "what time is it" and r.bot_text == "It" and not r.interrupted
    assert r.clocks.request_to_first_token_ms == 100
    assert r.clocks.turn_end_to_first_audio_ms == 910  # from speech end, not VAD stop
    assert r.clocks.itl_ms.p50 == 50.0
    b = r.breakdown
    assert (b.vad_hangover_ms, b.asr_final_ms, b.prefill_ms) == (500, 5.0, 80.0)
    assert (b.first_clause_ms, b.tts_first_chunk_ms) == (90, 200)


async def test_barge_in_marks_the_turn_interrupted_and_times_the_silence():
    records = []
    obs = ClocksObserver("call-1", records.append)
    await answered_turn(obs)
    # the caller talks over the bot from 2000; the VAD confirms it 100 ms later
    await push(obs, VADUserStartedSpeakingFrame(start_secs=0.1), 2100)
    await push(obs, InterruptionFrame(), 2120)
    await push(obs, BotStoppedSpeakingFrame(), 2150, src=OUT)
    await push(obs, engine_metrics(interrupted=True), 2160)
    [r] = records
    assert r.interrupted and r.interruption_to_silence_ms == 30
    assert r.barge_in_to_silence_ms == 150  # from when the caller actually started
    assert r.engine["interrupted"]


async def test_a_barge_in_decided_after_its_speech_ended_is_timed_from_that_speech():
    """With `turn.min_interrupt_s` the interruption may come after the VAD stop of the speech
    that earned it; a backchannel before it does not start the clock."""
    records = []
    obs = ClocksObserver("call-1", records.append)
    await answered_turn(obs)
    await push(obs, VADUserStartedSpeakingFrame(start_secs=0.1), 2100)  # "mm-hmm" from 2000
    await push(obs, VADUserStoppedSpeakingFrame(stop_secs=0.3), 2800)
    await push(obs, VADUserStartedSpeakingFrame(start_secs=0.1), 4100)  # "stop" from 4000
    await push(obs, VADUserStoppedSpeakingFrame(stop_secs=0.3), 5000)
    await push(obs, InterruptionFrame(), 5100)
    await push(obs, BotStoppedSpeakingFrame(), 5150, src=OUT)
    await push(obs, engine_metrics(interrupted=True), 5160)
    [r] = records
    assert r.interrupted and r.barge_in_to_silence_ms == 1150


async def test_an_interruption_after_the_reply_ended_is_not_a_barge_in():
    records = []
    obs = ClocksObserver("call-1", records.append)
    await answered_turn(obs)
    await push(obs, engine_metrics(), 2000)
    await push(obs, BotStoppedSpeakingFrame(), 2500, src=OUT)
    await push(obs, VADUserStartedSpeakingFrame(), 4000)
    await push(obs, InterruptionFrame(), 4020)
    assert len(records) == 1 and not records[0].interrupted


async def test_speech_without_a_request_is_not_a_turn():
    records = []
    obs = ClocksObserver("call-1", records.append)
    await push(obs, VADUserStartedSpeakingFrame(), 0)
    await push(obs, VADUserStoppedSpeakingFrame(stop_secs=0.5), 700)
    obs.flush()
    assert records == []


def test_percentiles_of_nothing_are_none():
    assert Percentiles.of([]) == Percentiles(None, None, None)
    assert Percentiles.of([1.0, 3.0]).p50 == 2.0


def _prepared_context(text: str) -> LLMContextFrame:
    return LLMContextFrame(LLMContext(messages=[{"role": "user", "content": text}]),
                           speculation=True)


def _prepared_metrics(tokens: int, discarded: bool) -> MetricsFrame:
    data = EngineStatsMetricsData(
        processor="llm", request_id="p", interrupted=discarded,
        finish_reason="cancelled" if discarded else "eos",
        stats={"itl_ms": [50.0], "generated_tokens": tokens, "method": "ngram"},
        prepared=True, discarded=discarded,
    )
    return MetricsFrame(data=[data])


async def test_withdrawn_then_committed_preparation_is_one_turn_with_its_waste():
    turns = []
    obs = ClocksObserver("c1", turns.append)
    await push(obs, VADUserStartedSpeakingFrame(), 0)
    # The caller pauses: a reply is prepared, then withdrawn when they go on.
    await push(obs, _prepared_context("what is the"), 900, dst=LLM)
    await push(obs, PreparedResponseStartFrame(), 901, src=LLM)
    await push(obs, LLMTextFrame("The"), 1000, src=LLM)
    await push(obs, EagerEndOfTurnCancelFrame(), 1100)
    await push(obs, LLMTextFrame(" stale"), 1101, src=LLM)  # pushed before the LLM saw it
    await push(obs, _prepared_metrics(3, discarded=True), 1110)
    await push(obs, MetricsFrame(data=[HeldAudioMetricsData(processor="gate",
                                                            discarded_audio_ms=250.0)]), 1111)
    # The sentence ends: a second preparation, confirmed by the turn end.
    await push(obs, _prepared_context("what is the time"), 2000, dst=LLM)
    await push(obs, PreparedResponseStartFrame(), 2001, src=LLM)
    await push(obs, LLMTextFrame("It is"), 2100, src=LLM)
    await push(obs, VADUserStoppedSpeakingFrame(stop_secs=0.5), 2300)
    await push(obs, TranscriptionFrame("What is the time?", "user", "now"), 2301)
    await push(obs, UserStoppedSpeakingFrame(), 2302)
    await push(obs, BotStartedSpeakingFrame(), 2310, src=OUT)
    await push(obs, _prepared_metrics(5, discarded=False), 2400)
    await push(obs, BotStoppedSpeakingFrame(), 3000, src=OUT)
    [turn] = turns
    prep = turn.preparation
    assert (prep.prepared, prep.committed, prep.discarded) == (2, True, 1)
    assert prep.lead_ms == 300  # the committed one started 300 ms before the VAD stop
    assert prep.prepared_text == "what is the time"
    assert (prep.discarded_tokens, prep.discarded_audio_ms, prep.answer_tokens) == (3, 250.0, 5)
    assert turn.llm_text == "It is"  # nothing of the withdrawn reply
    assert turn.clocks.request_to_first_token_ms == 100  # from the committed preparation
    assert turn.clocks.turn_end_to_first_audio_ms == 2310 - 1800
