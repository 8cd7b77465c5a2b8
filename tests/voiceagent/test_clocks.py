"""The clocks observer on scripted frame sequences (no models): what each clock measures."""

import dataclasses

from pipecat.frames.frames import (
    BotStartedSpeakingFrame,
    BotStoppedSpeakingFrame,
    EagerEndOfTurnCancelFrame,
    FunctionCallCancelFrame,
    FunctionCallInProgressFrame,
    FunctionCallResultFrame,
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

from llm_engine.stats import RequestStats, StepStats
from voiceagent.pipeline.clocks import ClocksObserver, heard_part
from voiceagent.pipeline.frames import PreparedResponseStartFrame, UserSpeechOnsetFrame
from voiceagent.pipeline.metrics import (
    ASRFinalMetricsData,
    EngineStatsMetricsData,
    HeldAudioMetricsData,
    RequestStartedMetricsData,
    TurnContinuesMetricsData,
)
from voiceagent.pipeline.turn_record import Percentiles, ToolCall, TurnStats

MS = 1_000_000  # ns


class FakeTTS(TTSService):
    async def run_tts(self, text, context_id):
        yield None


LLM, TTS = LLMService(), FakeTTS(sample_rate=16000)
OUT, OTHER = BaseOutputTransport(TransportParams()), FrameProcessor()


async def push(obs, frame, at_ms, src=OTHER, dst=OTHER):
    await obs.on_push_frame(FramePushed(src, dst, frame, FrameDirection.DOWNSTREAM, at_ms * MS))


async def dropped_by_transport(obs, at_ms):
    """The interruption reaches the output transport, which drops its audio (Twilio: `clear`)."""
    await obs.on_push_frame(FramePushed(OUT, OTHER, InterruptionFrame(),
                                        FrameDirection.DOWNSTREAM, at_ms * MS, first_push=False))


async def talked_over(obs, *, vad_ms, interruption_ms, dropped_ms, silent_ms, start_secs=0.2,
                      onset_ms=None):
    """A barge-in over the reply: the caller's onset (if the VAD found one), the VAD's start, the
    interruption, the transport dropping its audio, the bot silent, the cancelled request's
    stats."""
    if onset_ms is not None:
        await push(obs, UserSpeechOnsetFrame(onset_ns=onset_ms * MS), vad_ms)
    await push(obs, VADUserStartedSpeakingFrame(start_secs=start_secs), vad_ms)
    await push(obs, InterruptionFrame(), interruption_ms)
    await dropped_by_transport(obs, dropped_ms)
    await push(obs, BotStoppedSpeakingFrame(), silent_ms, src=OUT)
    await push(obs, engine_metrics(interrupted=True), silent_ms + 10)


def engine_metrics(interrupted=False, itl=(50.0, 0.0, 60.0)):
    stats = RequestStats(itl_ms=list(itl), prefill_ms=80.0, method="ngram")
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
    question = {"role": "user", "content": "what time is it"}
    await push(obs, LLMContextFrame(LLMContext(messages=[question])), t0 + 1510, dst=LLM)
    await push(obs, LLMTextFrame("It is"), t0 + 1610, src=LLM)
    await push(obs, TTSStartedFrame(), t0 + 1700, src=TTS)
    await push(obs, TTSAudioRawFrame(b"\0\0" * 160, 16000, 1), t0 + 1900, src=TTS)
    await push(obs, BotStartedSpeakingFrame(), t0 + 1910, src=OUT)
    await push(obs, TTSTextFrame("It", text_type="word"), t0 + 1920, src=OUT)


async def observing(start) -> tuple[ClocksObserver, list]:
    """An observer of call-1 with `start(obs)` pushed, and the list its records go to."""
    records = []
    obs = ClocksObserver("call-1", records.append)
    await start(obs)
    return obs, records


async def test_answered_turn_has_the_three_clocks_and_breakdown():
    obs, records = await observing(answered_turn)
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
    obs, records = await observing(answered_turn)
    # the caller talks over the bot from 2000; the VAD confirms it 100 ms later
    await talked_over(obs, vad_ms=2100, start_secs=0.1, interruption_ms=2120, dropped_ms=2140,
                      silent_ms=2150)
    [r] = records
    assert r.interrupted and r.interruption_to_silence_ms == 30
    assert r.barge_in_to_silence_ms == 150  # from when the caller actually started
    assert r.engine.interrupted


async def test_barge_in_is_timed_from_the_first_voiced_frame_in_detection_and_stopping():
    obs, records = await observing(answered_turn)
    # The caller's first voiced frame arrived at 2000; the VAD confirmed speech at 2450 (its
    # smoothed volume and start_secs), the interruption followed at 2470, silence at 2500.
    await talked_over(obs, onset_ms=2000, vad_ms=2450, interruption_ms=2470, dropped_ms=2490,
                      silent_ms=2500)
    [r] = records
    assert r.barge_in_to_silence_ms == 500  # not 250: the VAD's start minus start_secs
    assert (r.barge_in_detection_ms, r.interruption_to_silence_ms) == (470, 30)


async def test_a_barge_in_ends_when_the_transport_drops_the_audio_if_that_comes_later():
    """On Twilio the bot is silent when the `clear` goes out, which the transport sends when the
    interruption reaches it; a BotStoppedSpeakingFrame can come before it."""
    obs, records = await observing(answered_turn)
    await push(obs, UserSpeechOnsetFrame(onset_ns=2000 * MS), 2450)
    await push(obs, VADUserStartedSpeakingFrame(start_secs=0.2), 2450)
    await push(obs, InterruptionFrame(), 2470)
    await push(obs, BotStoppedSpeakingFrame(), 2480, src=OUT)
    await push(obs, engine_metrics(interrupted=True), 2490)
    assert records == []  # the audio is still queued at the transport
    await dropped_by_transport(obs, 2560)
    [r] = records
    assert (r.barge_in_to_silence_ms, r.interruption_to_silence_ms) == (560, 90)


def test_heard_part_keeps_the_words_whose_end_was_played():
    text = "The time is 12:12:12."
    assert heard_part(text, 0.0) == ""
    assert heard_part(text, 0.55) == "The time is"  # "is" ends at 11 of 21 characters
    assert heard_part(text, 0.5) == "The time"
    assert heard_part(text, 1.0) == text


async def test_an_interrupted_turn_keeps_the_words_its_played_audio_carried():
    obs, records = await observing(answered_turn)  # "It" played to its end
    second = TTSAudioRawFrame(b"\0\0" * 16000, 16000, 1)  # a 1 s clause
    await push(obs, second, 2000, src=TTS)
    await push(obs, TTSTextFrame("The time is 12:12:12.", text_type="sentence"), 2001, src=TTS)
    for i in range(6):  # 0.6 s of it played
        await push(obs, TTSAudioRawFrame(b"\0\0" * 1600, 16000, 1), 2100 + 100 * i, src=OUT)
    await talked_over(obs, vad_ms=2700, interruption_ms=2710, dropped_ms=2715, silent_ms=2720)
    [r] = records
    assert r.interrupted and r.bot_text == "It The time is"


async def test_a_reply_after_a_withdrawn_one_has_its_tts_stages_before_its_start_frame():
    """The TTS queues a reply's LLMFullResponseStartFrame behind its audio contexts, so the next
    reply's TTSStartedFrame and audio can come before it: they are that reply's, while frames of
    the withdrawn reply's TTS context are not."""
    records = []
    obs = ClocksObserver("c1", records.append)
    await push(obs, VADUserStartedSpeakingFrame(), 0)
    await prepared_reply(obs, "what is the", 900, "The", 1000)
    await push(obs, TTSStartedFrame(context_id="old"), 1010, src=TTS)
    await push(obs, EagerEndOfTurnCancelFrame(), 1100)
    await push(obs, TTSAudioRawFrame(b"\0\0" * 160, 16000, 1, context_id="old"), 1101, src=TTS)
    await prepared_reply(obs, "what is the time", 2000, "It is", 2100)
    await push(obs, TTSStartedFrame(context_id="new"), 2150, src=TTS)
    await push(obs, TTSAudioRawFrame(b"\0\0" * 160, 16000, 1, context_id="new"), 2250, src=TTS)
    await push(obs, PreparedResponseStartFrame(), 2251, src=TTS)
    await confirmed_and_played(obs)
    [turn] = records
    assert (turn.breakdown.first_clause_ms, turn.breakdown.tts_first_chunk_ms) == (50, 100)
    assert turn.breakdown.chunk_to_audio_ms == 60


async def test_a_barge_in_decided_after_its_speech_ended_is_timed_from_that_speech():
    """With `turn.min_interrupt_s` the interruption may come after the VAD stop of the speech
    that earned it; a backchannel before it does not start the clock."""
    obs, records = await observing(answered_turn)
    await push(obs, VADUserStartedSpeakingFrame(start_secs=0.1), 2100)  # "mm-hmm" from 2000
    await push(obs, VADUserStoppedSpeakingFrame(stop_secs=0.3), 2800)
    await push(obs, VADUserStartedSpeakingFrame(start_secs=0.1), 4100)  # "stop" from 4000
    await push(obs, VADUserStoppedSpeakingFrame(stop_secs=0.3), 5000)
    await push(obs, InterruptionFrame(), 5100)
    await dropped_by_transport(obs, 5140)
    await push(obs, BotStoppedSpeakingFrame(), 5150, src=OUT)
    await push(obs, engine_metrics(interrupted=True), 5160)
    [r] = records
    assert r.interrupted and r.barge_in_to_silence_ms == 1150


async def test_an_interruption_after_the_reply_ended_is_not_a_barge_in():
    obs, records = await observing(answered_turn)
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


async def prepared_reply(obs, words: str, at_ms: int, first: str, first_ms: int) -> None:
    """A reply prepared on `words` at `at_ms`: its context, its start, its `first` text."""
    context = LLMContext(messages=[{"role": "user", "content": words}])
    await push(obs, LLMContextFrame(context, speculation=True), at_ms, dst=LLM)
    await push(obs, PreparedResponseStartFrame(), at_ms + 1, src=LLM)
    await push(obs, LLMTextFrame(first), first_ms, src=LLM)


def _prepared_metrics(tokens: int, discarded: bool) -> MetricsFrame:
    data = EngineStatsMetricsData(
        processor="llm", request_id="p", interrupted=discarded,
        finish_reason="cancelled" if discarded else "eos",
        stats=RequestStats(itl_ms=[50.0], generated_tokens=tokens, method="ngram"),
        prepared=True, discarded=discarded,
    )
    return MetricsFrame(data=[data])


async def confirmed_and_played(obs):
    """The turn ends at 2300 (speech ended at 1800) and the prepared reply is heard."""
    await push(obs, VADUserStoppedSpeakingFrame(stop_secs=0.5), 2300)
    await push(obs, TranscriptionFrame("What is the time?", "user", "now"), 2301)
    await push(obs, UserStoppedSpeakingFrame(), 2302)
    await push(obs, BotStartedSpeakingFrame(), 2310, src=OUT)
    await push(obs, _prepared_metrics(5, discarded=False), 2400)
    await push(obs, BotStoppedSpeakingFrame(), 3000, src=OUT)


async def test_withdrawn_then_committed_preparation_is_one_turn_with_its_waste():
    turns = []
    obs = ClocksObserver("c1", turns.append)
    await push(obs, VADUserStartedSpeakingFrame(), 0)
    # The caller pauses: a reply is prepared, then withdrawn when they go on.
    await prepared_reply(obs, "what is the", 900, "The", 1000)
    await push(obs, EagerEndOfTurnCancelFrame(), 1100)
    await push(obs, LLMTextFrame(" stale"), 1101, src=LLM)  # pushed before the LLM saw it
    await push(obs, _prepared_metrics(3, discarded=True), 1110)
    await push(obs, MetricsFrame(data=[HeldAudioMetricsData(processor="gate",
                                                            discarded_audio_ms=250.0)]), 1111)
    # The sentence ends: a second preparation, confirmed by the turn end.
    await prepared_reply(obs, "what is the time", 2000, "It is", 2100)
    await confirmed_and_played(obs)
    [turn] = turns
    prep = turn.preparation
    assert (prep.prepared, prep.committed, prep.discarded) == (2, True, 1)
    assert prep.lead_ms == 300  # the committed one started 300 ms before the VAD stop
    assert prep.prepared_text == "what is the time"
    assert (prep.discarded_tokens, prep.discarded_audio_ms, prep.answer_tokens) == (3, 250.0, 5)
    assert turn.llm_text == "It is"  # nothing of the withdrawn reply
    assert turn.clocks.request_to_first_token_ms == 100  # from the committed preparation
    assert turn.clocks.turn_end_to_first_audio_ms == 2310 - 1800



def _stats(request_id: str, *, cancelled: bool) -> MetricsFrame:
    return MetricsFrame(data=[EngineStatsMetricsData(
        processor="llm", request_id=request_id, interrupted=cancelled,
        finish_reason="cancelled" if cancelled else "eos",
        stats=RequestStats(itl_ms=[50.0], generated_tokens=9 if cancelled else 4, method="ngram",
                           finish_reason="cancelled" if cancelled else "eos"),
        prepared=True)])


async def prepared_request(obs, request_id: str, words: str, at_ms: int, first: str) -> None:
    """A prepared reply as the LLM service starts it: its context, its request, its text."""
    await prepared_reply(obs, words, at_ms, first, at_ms + 100)
    await push(obs, MetricsFrame(data=[RequestStartedMetricsData(
        processor="llm", request_id=request_id, prepared=True)]), at_ms + 2, src=LLM)


async def test_a_cancelled_reply_whose_stats_come_after_the_next_preparation_keeps_them():
    """On a loaded machine the stats of a reply cut off by a barge-in came after the caller's
    next words were being prepared; they went to that next turn, and the interrupted turn was
    written without any."""
    obs, records = await observing(lambda obs: push(obs, VADUserStartedSpeakingFrame(), 0))
    await prepared_request(obs, "r1", "tell me a story", 900, "Once upon a time,")
    await push(obs, VADUserStoppedSpeakingFrame(stop_secs=0.3), 1300)
    await push(obs, TranscriptionFrame("Tell me a story.", "user", "now"), 1301)
    await push(obs, UserStoppedSpeakingFrame(), 1302)
    await push(obs, TTSStartedFrame(), 1350, src=TTS)
    await push(obs, BotStartedSpeakingFrame(), 1400, src=OUT)
    await talked_over_without_stats(obs, at_ms=2000)
    await prepared_request(obs, "r2", "stop", 2600, "Sorry.")
    await push(obs, _stats("r1", cancelled=True), 2750)  # late: the worker was busy
    await push(obs, VADUserStoppedSpeakingFrame(stop_secs=0.3), 2900)
    await push(obs, TranscriptionFrame("Stop.", "user", "now"), 2901)
    await push(obs, UserStoppedSpeakingFrame(), 2902)
    await push(obs, BotStartedSpeakingFrame(), 3000, src=OUT)
    await push(obs, _stats("r2", cancelled=False), 3100)
    await push(obs, BotStoppedSpeakingFrame(), 3500, src=OUT)
    story, stop = records
    assert story.interrupted and story.engine.finish_reason == "cancelled"
    assert story.engine.generated_tokens == 9
    assert stop.engine.finish_reason == "eos" and stop.engine.generated_tokens == 4


async def test_a_superseded_preparations_late_stats_do_not_replace_the_answers():
    """A reply prepared at a pause, then the turn answered by a fresh request (its words had
    changed): the cancelled preparation's stats came after the answer's (a remote server's
    cancel on a loaded machine) and were written as the turn's, with none of its tokens."""
    obs, records = await observing(lambda obs: push(obs, VADUserStartedSpeakingFrame(), 0))
    await prepared_request(obs, "p1", "and what about", 900, "The")
    await push(obs, VADUserStoppedSpeakingFrame(stop_secs=0.3), 1300)
    await push(obs, TranscriptionFrame("And what about Spain?", "user", "now"), 1301)
    question = {"role": "user", "content": "And what about Spain?"}
    await push(obs, LLMContextFrame(LLMContext(messages=[question])), 1310, dst=LLM)
    await push(obs, MetricsFrame(data=[RequestStartedMetricsData(
        processor="llm", request_id="r2", prepared=False)]), 1311, src=LLM)
    await push(obs, LLMTextFrame("Madrid."), 1400, src=LLM)
    await push(obs, TTSStartedFrame(), 1450, src=TTS)
    await push(obs, BotStartedSpeakingFrame(), 1500, src=OUT)
    await push(obs, _stats("r2", cancelled=False), 1600)
    await push(obs, _stats("p1", cancelled=True), 1700)  # late
    await push(obs, BotStoppedSpeakingFrame(), 2500, src=OUT)
    [turn] = records
    assert turn.engine.request_id == "r2" and turn.engine.generated_tokens == 4
    assert turn.preparation.discarded_tokens == 9


async def talked_over_without_stats(obs, at_ms: int) -> None:
    await push(obs, VADUserStartedSpeakingFrame(), at_ms)
    await push(obs, InterruptionFrame(), at_ms + 10)
    await dropped_by_transport(obs, at_ms + 20)
    await push(obs, BotStoppedSpeakingFrame(), at_ms + 30, src=OUT)


async def ended_at_a_comma(obs, *, goes_on: bool):
    """"What is the capital of Spain," ends a turn at its comma (speech 0-800 ms, VAD stop at
    1100); the reply's first clause is synthesised, and the caller speaks again at 1300 before
    any of it plays. Their next words end at 2000 (VAD stop 2300) and are answered, heard at
    2600; `goes_on`: as one message with the first words (TurnContinuesMetricsData)."""
    await push(obs, VADUserStartedSpeakingFrame(), 0)
    await push(obs, VADUserStoppedSpeakingFrame(stop_secs=0.3), 1100)
    await push(obs, TranscriptionFrame("What is the capital of Spain.", "user", "now"), 1105)
    await push(obs, LLMContextFrame(LLMContext(messages=[{"role": "user", "content": "x"}])),
               1110, dst=LLM)
    await push(obs, LLMTextFrame("The capital"), 1200, src=LLM)
    await push(obs, TTSStartedFrame(), 1210, src=TTS)
    await push(obs, TTSAudioRawFrame(b"\0\0" * 3200, 16000, 1), 1250, src=TTS)
    await push(obs, VADUserStartedSpeakingFrame(), 1300)
    await push(obs, InterruptionFrame(), 1310)
    await push(obs, _prepared_metrics(4, discarded=False), 1320)
    await push(obs, VADUserStoppedSpeakingFrame(stop_secs=0.3), 2300)
    await push(obs, TranscriptionFrame("and why is it there?", "user", "now"), 2305)
    await push(obs, LLMContextFrame(LLMContext(messages=[{"role": "user", "content": "y"}])),
               2310, dst=LLM)
    if goes_on:
        await push(obs, MetricsFrame(data=[TurnContinuesMetricsData(processor="llm")]), 2311)
    await push(obs, LLMTextFrame("Madrid"), 2400, src=LLM)
    await push(obs, BotStartedSpeakingFrame(), 2600, src=OUT)
    await push(obs, TTSTextFrame("Madrid", text_type="word"), 2650, src=OUT)
    await push(obs, engine_metrics(), 2700)
    await push(obs, BotStoppedSpeakingFrame(), 3000, src=OUT)


async def test_a_turn_the_caller_went_on_from_unheard_is_one_record_with_the_next():
    obs, records = await observing(lambda obs: ended_at_a_comma(obs, goes_on=True))
    [r] = records
    assert r.user_text == "What is the capital of Spain. and why is it there?"
    assert r.early_ends == 1 and not r.continues and not r.interrupted
    assert r.turn == 1 and r.bot_text == "Madrid"
    assert r.breakdown.user_speech_ms == 2000  # from the first words to the last
    assert r.clocks.turn_end_to_first_audio_ms == 600  # from the end of the last words
    prep = r.preparation
    assert (prep.discarded, prep.discarded_tokens, prep.discarded_audio_ms) == (1, 4, 200.0)


async def test_a_turn_withdrawn_unheard_that_nobody_went_on_with_is_its_own_record():
    obs, records = await observing(lambda obs: ended_at_a_comma(obs, goes_on=False))
    assert [(r.turn, r.interrupted, r.early_ends) for r in records] == [(1, True, 0),
                                                                        (2, False, 0)]
    assert records[0].user_text == "What is the capital of Spain."


async def test_a_call_that_ends_after_a_reply_withdrawn_unheard_keeps_that_turn():
    records = []
    obs = ClocksObserver("call-1", records.append)
    await push(obs, VADUserStartedSpeakingFrame(), 0)
    await push(obs, VADUserStoppedSpeakingFrame(stop_secs=0.3), 1100)
    await push(obs, TranscriptionFrame("Hello.", "user", "now"), 1105)
    await push(obs, LLMContextFrame(LLMContext(messages=[{"role": "user", "content": "x"}])),
               1110, dst=LLM)
    await push(obs, VADUserStartedSpeakingFrame(), 1300)
    await push(obs, InterruptionFrame(), 1310)
    await push(obs, engine_metrics(interrupted=True), 1320)
    assert records == []  # kept until the next turn says whether the caller went on with it
    obs.flush()
    [r] = records
    assert r.user_text == "Hello." and r.interrupted

# -- a tool turn: the first request calls a tool, a second one answers from its result -----------

ORDER = {"order_id": "A17"}


async def broadcast(obs, frame_cls, at_ms, **fields):
    """As pipecat's LLMService.broadcast_frame: one frame each way, then each on its next hop."""
    down, up = frame_cls(**fields), frame_cls(**fields)
    await obs.on_push_frame(FramePushed(LLM, TTS, down, FrameDirection.DOWNSTREAM, at_ms * MS))
    await obs.on_push_frame(FramePushed(LLM, OTHER, up, FrameDirection.UPSTREAM, (at_ms + 1) * MS))
    await obs.on_push_frame(FramePushed(TTS, OUT, down, FrameDirection.DOWNSTREAM,
                                        (at_ms + 2) * MS, first_push=False))


def request_metrics(request_id, itl, tokens, by_pos):
    stats = RequestStats(itl_ms=list(itl), prefill_ms=30.0, method="ngram",
                         generated_tokens=tokens, drafted_by_pos=list(by_pos), k_history=[4])
    return MetricsFrame(data=[EngineStatsMetricsData(
        processor="llm", request_id=request_id, interrupted=False, finish_reason="eos",
        stats=stats)])


def tool_result_context() -> LLMContextFrame:
    return LLMContextFrame(LLMContext(messages=[
        {"role": "user", "content": "where is my order"},
        {"role": "assistant", "tool_calls": [{"id": "t1", "type": "function", "function": {
            "name": "lookup_order", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "{}"},
    ]))


async def tool_call(obs, start_ms, result, call_id="t1", name="lookup_order"):
    await broadcast(obs, FunctionCallInProgressFrame, start_ms, function_name=name,
                    tool_call_id=call_id, arguments=ORDER)
    if result is not None:
        await broadcast(obs, FunctionCallResultFrame, start_ms + 500, function_name=name,
                        tool_call_id=call_id, arguments=ORDER, result=result)


async def tool_turn_until_the_tool(obs):
    """The caller asks (speech ended at 1000); the first request (1510) calls a tool at 1600,
    with no text, and its stats are in at 1605."""
    await push(obs, VADUserStartedSpeakingFrame(), 0)
    await push(obs, VADUserStoppedSpeakingFrame(stop_secs=0.5), 1500)
    await push(obs, TranscriptionFrame("where is my order", "user", "now"), 1505)
    await push(obs, LLMContextFrame(LLMContext()), 1510, dst=LLM)
    await push(obs, request_metrics("r1", [10.0, 10.0], 3, [1, 1]), 1605)


async def the_reply(obs, request_ms=2110):
    await push(obs, tool_result_context(), request_ms, dst=LLM)
    await push(obs, LLMTextFrame("It shipped"), request_ms + 90, src=LLM)
    await push(obs, TTSStartedFrame(), request_ms + 140, src=TTS)
    await push(obs, TTSAudioRawFrame(b"\0\0" * 160, 16000, 1), request_ms + 290, src=TTS)
    await push(obs, BotStartedSpeakingFrame(), request_ms + 300, src=OUT)
    await push(obs, request_metrics("r2", [50.0, 70.0], 4, [2]), request_ms + 390)
    await push(obs, BotStoppedSpeakingFrame(), request_ms + 900, src=OUT)


async def test_a_tool_turn_is_one_turn_with_its_tool_call_and_clocks_across_it():
    obs, records = await observing(tool_turn_until_the_tool)
    await tool_call(obs, 1600, {"order_id": "A17", "status": "shipped"})
    # A filler while the tool runs: heard, but it is not the reply.
    await push(obs, TTSStartedFrame(), 1700, src=TTS)
    await push(obs, TTSAudioRawFrame(b"\0\0" * 160, 16000, 1), 1750, src=TTS)
    await push(obs, BotStartedSpeakingFrame(), 1760, src=OUT)
    await push(obs, BotStoppedSpeakingFrame(), 2000, src=OUT)
    assert records == []  # the first request ended, its stats are in, the filler played
    await the_reply(obs)
    [r] = records
    result_chars = len('{"order_id": "A17", "status": "shipped"}')
    assert r.tool_calls == [ToolCall("lookup_order", 500.0, result_chars, ok=True)]
    assert r.llm_text == "It shipped"
    assert r.clocks.request_to_first_token_ms == 2200 - 1510  # the first request: spans the tool
    assert r.clocks.turn_end_to_first_audio_ms == 2410 - 1000  # the reply's audio, not the filler
    b = r.breakdown
    assert (b.tool_call_ms, b.tools_ms, b.first_token_ms) == (90, 2110 - 1600, 90)
    assert (b.first_clause_ms, b.tts_first_chunk_ms, b.chunk_to_audio_ms) == (50, 150, 10)
    assert b.filler_audio_ms == 760
    # Both requests' stats: the tool call's generation counts too.
    assert r.engine.itl_ms == [10.0, 10.0, 50.0, 70.0] and r.engine.generated_tokens == 7
    assert r.engine.drafted_by_pos == [3, 1] and r.engine.request_id == "r2"
    assert r.clocks.itl_ms.p50 == 30.0 and r.breakdown.prefill_ms == 30.0


async def test_a_tool_turn_whose_preparation_was_superseded_still_ends():
    """Prepared at a pause, then answered by a fresh request that calls a tool: the superseded
    preparation's stats count as its waste and as reported, so the turn ends when the reply to
    the tool's result has played (it had waited for a report already counted out)."""
    obs, records = await observing(lambda obs: push(obs, VADUserStartedSpeakingFrame(), 0))
    await prepared_request(obs, "p1", "where is my", 900, "Your")
    await push(obs, VADUserStoppedSpeakingFrame(stop_secs=0.5), 1500)
    await push(obs, TranscriptionFrame("where is my order", "user", "now"), 1505)
    await push(obs, LLMContextFrame(LLMContext()), 1510, dst=LLM)
    await push(obs, MetricsFrame(data=[RequestStartedMetricsData(
        processor="llm", request_id="r1", prepared=False)]), 1511, src=LLM)
    await push(obs, _stats("p1", cancelled=True), 1520)
    await push(obs, request_metrics("r1", [10.0, 10.0], 3, [1, 1]), 1605)
    await tool_call(obs, 1600, {"order_id": "A17", "status": "shipped"})
    await the_reply(obs)
    [r] = records
    assert [call.name for call in r.tool_calls] == ["lookup_order"]
    assert r.engine.generated_tokens == 7 and r.preparation.discarded_tokens == 9


async def test_a_failed_tool_is_recorded_not_ok_and_turns_stay_apart():
    obs, records = await observing(tool_turn_until_the_tool)
    await tool_call(obs, 1600, {"error": "lookup_order took longer than 5 s"})
    await the_reply(obs)
    await answered_turn(obs, t0=5000)  # the next question: a turn of its own, no tools
    await push(obs, engine_metrics(), 7000)
    await push(obs, BotStoppedSpeakingFrame(), 7500, src=OUT)
    first, second = records
    [call] = first.tool_calls
    assert (call.ok, call.outcome, call.duration_ms) == (False, "error", 500)
    assert second.tool_calls == [] and second.breakdown.tool_call_ms is None
    assert second.clocks.request_to_first_token_ms == 100


async def test_the_reply_to_a_tool_stays_on_its_turn_when_the_caller_speaks_meanwhile():
    obs, records = await observing(tool_turn_until_the_tool)
    await tool_call(obs, 1600, {"status": "shipped"})
    await push(obs, VADUserStartedSpeakingFrame(), 2050)  # "hm?", no interruption
    await the_reply(obs)
    [r] = records
    assert r.clocks.request_to_first_token_ms == 690 and r.breakdown.tools_ms == 510


async def test_a_tool_result_spoken_from_its_template_ends_the_turn_when_played():
    obs, records = await observing(tool_turn_until_the_tool)
    await tool_call(obs, 1600, None)
    # The tool's `say` template: the result goes to the context without a request; its text
    # is the reply.
    await broadcast(obs, FunctionCallResultFrame, 1610, function_name="lookup_order",
                    tool_call_id="t1", arguments=ORDER, result={"status": "shipped"},
                    run_llm=False)
    await push(obs, LLMTextFrame("Order A 1 7 is shipped."), 1615, src=LLM)
    await push(obs, TTSStartedFrame(), 1620, src=TTS)
    await push(obs, TTSAudioRawFrame(b"\0\0" * 160, 16000, 1), 1700, src=TTS)
    await push(obs, BotStartedSpeakingFrame(), 1710, src=OUT)
    await push(obs, BotStoppedSpeakingFrame(), 3000, src=OUT)
    [r] = records  # complete once played: no reply to its result is awaited
    assert not r.interrupted and r.llm_text == "Order A 1 7 is shipped."
    assert r.clocks.turn_end_to_first_audio_ms == 1710 - 1000


async def test_a_tool_result_nobody_answers_leaves_the_next_question_its_own_turn():
    obs, records = await observing(tool_turn_until_the_tool)
    await tool_call(obs, 1600, None)
    await broadcast(obs, FunctionCallResultFrame, 2100, function_name="lookup_order",
                    tool_call_id="t1", arguments=ORDER, result={"done": True}, run_llm=False)
    await answered_turn(obs, t0=3000)  # its context ends with the caller's words
    [tool_turn] = records
    assert tool_turn.tool_calls[0].ok and tool_turn.clocks.request_to_first_token_ms is None
    await push(obs, engine_metrics(), 5000)
    await push(obs, BotStoppedSpeakingFrame(), 5500, src=OUT)
    assert records[1].user_text == "what time is it"
    assert records[1].clocks.request_to_first_token_ms == 100


async def test_a_barge_in_during_a_tool_call_ends_the_turn_with_the_call_cancelled():
    obs, records = await observing(tool_turn_until_the_tool)
    await tool_call(obs, 1600, None)
    await push(obs, VADUserStartedSpeakingFrame(start_secs=0.1), 1900)
    await push(obs, InterruptionFrame(), 1910)
    await broadcast(obs, FunctionCallCancelFrame, 1920, function_name="lookup_order",
                    tool_call_id="t1")
    [r] = records
    assert r.interrupted and r.clocks.turn_end_to_first_audio_ms is None
    assert r.tool_calls == [ToolCall("lookup_order", 320.0, None, ok=False, cancelled=True)]
    assert r.tool_calls[0].outcome == "cancelled"
    # The caller's new question is the next turn, not the tool's reply.
    await push(obs, VADUserStoppedSpeakingFrame(stop_secs=0.5), 3000)
    await push(obs, TranscriptionFrame("never mind", "user", "now"), 3005)
    await push(obs, LLMContextFrame(LLMContext(messages=[
        {"role": "user", "content": "never mind"}])), 3010, dst=LLM)
    await push(obs, LLMTextFrame("Sure"), 3100, src=LLM)
    await push(obs, BotStartedSpeakingFrame(), 3300, src=OUT)
    await push(obs, engine_metrics(), 3400)
    await push(obs, BotStoppedSpeakingFrame(), 3600, src=OUT)
    assert [t.user_text for t in records] == ["where is my order", "never mind"]
    assert records[1].clocks.request_to_first_token_ms == 90


def test_merged_stats_of_a_plain_engine_request_keep_the_derived_figures_right():
    step = StepStats(k=2, drafted=2, accepted=1, rejection_pos=1, committed=2, draft_ms=0.5,
                     verify_ms=9.0)
    one = TurnStats(method="ngram", steps=[step], accept_len_hist=[0, 1], error="first failed")
    two = TurnStats(method="ngram", accept_len_hist=[0, 1, 1], request_id="r2",
                    steps=[step, dataclasses.replace(step, accepted=2, rejection_pos=None)])
    merged = one.merge(two)
    assert (merged.drafted, merged.accepted, merged.accept_len_hist) == (6, 4, [0, 2, 1])
    assert merged.mean_accepted_per_step == 4 / 3
    assert (merged.request_id, merged.error) == ("r2", "first failed")
