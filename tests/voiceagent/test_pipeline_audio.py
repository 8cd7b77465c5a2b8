"""The pipecat adapters of the audio side: VAD analyzer, streaming STT service, clause TTS service.

Run through pipecat's own test harness (`run_test`) with speech synthesised by the Piper voice.
"""

import asyncio
import threading
import time

import numpy as np
import pytest
from pipecat.audio.vad.vad_analyzer import VADState
from pipecat.frames.frames import (
    InputAudioRawFrame,
    InterimTranscriptionFrame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    MetricsFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.observers.base_observer import BaseObserver, FramePushed
from pipecat.pipeline.worker import PipelineParams
from pipecat.tests.utils import SleepFrame, run_test
from piper import SynthesisConfig

from audio import asr
from audio.asr import StreamingTranscriber
from audio.config import ASRConfig, TTSConfig, VADConfig
from audio.wav import frames
from tests.audio.speech import misheard, silence, speech
from voiceagent.models import resolve
from voiceagent.pipeline.frames import UserSpeechPausedFrame
from voiceagent.pipeline.metrics import ASRFinalMetricsData
from voiceagent.pipeline.speech_worker import CRITICAL, Openings, SpeechWorker
from voiceagent.pipeline.stt import StreamingWhisperSTTService, _same_words, load_asr_model
from voiceagent.pipeline.tts import load_tts_voice, make_tts
from voiceagent.pipeline.vad import load_vad_model, make_vad

QUESTION = "What is the capital of France?"



def audio_frames(samples: np.ndarray, rate: int = 16000, every: int = 0, sleep: float = 0.0):
    """20 ms InputAudioRawFrames, with a SleepFrame after each `every` frames (pacing)."""
    out = []
    for i, chunk in enumerate(frames(samples, rate), start=1):
        out.append(InputAudioRawFrame(chunk.tobytes(), rate, 1))
        if every and i % every == 0:
            out.append(SleepFrame(sleep))
    return out


# VAD


@pytest.fixture(scope="module")
def vad_model():
    return load_vad_model(VADConfig())


async def test_vad_uses_the_silero_vad_package_model(vad_model):
    path = vad_model.session._model_path  # onnxruntime's record of the file it loaded
    assert path == resolve("silero-vad", "vad").location
    assert "silero_vad" in path and "pipecat" not in path


async def test_calls_share_the_vad_session_but_not_its_state(vad_model):
    a, b = make_vad(VADConfig(), vad_model), make_vad(VADConfig(), vad_model)
    assert a._model.session is b._model.session is vad_model.session
    a.set_sample_rate(16000)
    for chunk in frames(speech(QUESTION), 16000):
        await a.analyze_audio(chunk.tobytes())
    assert a._model._state.any()  # Silero's recurrent state, after speech ...
    assert not b._model._state.any()  # ... is the call's own


async def test_vad_detects_speech_and_silence(vad_model):
    cfg = VADConfig(start_secs=0.2, stop_secs=0.5)
    vad = make_vad(cfg, vad_model)
    vad.set_sample_rate(16000)
    audio = np.concatenate([silence(1.0), speech(QUESTION), silence(1.0)])
    states = [(await vad.analyze_audio(c.tobytes())) for c in frames(audio, 16000)]
    speech_start, speech_end = 50, 50 + len(speech(QUESTION)) // 320  # in 20 ms frames
    assert all(s == VADState.QUIET for s in states[:speech_start])
    assert VADState.SPEAKING in states[speech_start : speech_start + 25]  # within 0.5 s
    assert states[-1] == VADState.QUIET
    assert VADState.SPEAKING not in states[speech_end + 35 :]  # stopped by stop_secs + 0.2 s


# STT


@pytest.fixture(scope="module")
def whisper():
    return load_asr_model(ASRConfig())


def stt_results(down):
    interims = [f for f in down if isinstance(f, InterimTranscriptionFrame)]
    finals = [f for f in down if isinstance(f, TranscriptionFrame)]
    metrics = [
        d for f in down if isinstance(f, MetricsFrame) for d in f.data
        if isinstance(d, ASRFinalMetricsData)
    ]
    return interims, finals, metrics


async def test_stt_pushes_interims_while_speaking_then_the_final(whisper):
    stt = StreamingWhisperSTTService(model=whisper, cfg=ASRConfig(interim_every_ms=300))
    send = [
        *audio_frames(silence(0.3)),
        VADUserStartedSpeakingFrame(start_secs=0.2),
        *audio_frames(speech(QUESTION), every=10, sleep=0.1),  # 2x real time
        *audio_frames(silence(0.5)),
        VADUserStoppedSpeakingFrame(stop_secs=0.5),
    ]
    down, _ = await run_test(stt, frames_to_send=send)
    interims, finals, metrics = stt_results(down)
    assert interims, "no interim transcript while speaking"
    assert len(finals) == 1 and misheard(finals[0].text, QUESTION) <= 1
    assert finals[0].finalized and finals[0].user_id == "" and finals[0].timestamp
    assert down.index(interims[-1]) < down.index(finals[0])
    assert len(metrics) == 1 and metrics[0].final_ms > 0
    assert metrics[0].audio_ms >= len(speech(QUESTION)) / 16
    # audio and VAD frames pass through
    assert sum(isinstance(f, InputAudioRawFrame) for f in down) > 100
    assert sum(isinstance(f, VADUserStoppedSpeakingFrame) for f in down) == 1


async def test_stt_final_reuses_an_interim_that_covered_the_speech(whisper):
    stt = StreamingWhisperSTTService(model=whisper, cfg=ASRConfig())
    send = [
        VADUserStartedSpeakingFrame(),
        *audio_frames(speech(QUESTION)),
        SleepFrame(1.5),  # the interims in flight finish
        *audio_frames(silence(0.5)),  # starts an interim covering all the speech
        VADUserStoppedSpeakingFrame(stop_secs=0.5),
    ]
    down, _ = await run_test(stt, frames_to_send=send)
    _, finals, metrics = stt_results(down)
    assert misheard(finals[0].text, QUESTION) <= 1
    assert metrics[0].reused_interim
    print(f"ASR final (waited for the interim in flight, reused it): {metrics[0].final_ms:.0f} ms")


async def test_stt_final_runs_the_model_when_no_interim_covered_the_speech(whisper):
    stt = StreamingWhisperSTTService(model=whisper, cfg=ASRConfig(interim_every_ms=60_000))
    send = [
        VADUserStartedSpeakingFrame(),
        *audio_frames(speech(QUESTION)),
        *audio_frames(silence(0.5)),
        VADUserStoppedSpeakingFrame(stop_secs=0.5),
    ]
    down, _ = await run_test(stt, frames_to_send=send)
    interims, finals, metrics = stt_results(down)
    assert not interims
    assert misheard(finals[0].text, QUESTION) <= 1
    assert not metrics[0].reused_interim
    print(f"ASR final without reuse: {metrics[0].final_ms:.0f} ms after VAD stop")


async def test_stt_resamples_8khz_input(whisper):
    stt = StreamingWhisperSTTService(model=whisper, cfg=ASRConfig())
    send = [
        VADUserStartedSpeakingFrame(),
        *audio_frames(speech(QUESTION, 8000), rate=8000),
        *audio_frames(silence(0.5, 8000), rate=8000),
        VADUserStoppedSpeakingFrame(stop_secs=0.5),
    ]
    down, _ = await run_test(
        stt, frames_to_send=send, pipeline_params=PipelineParams(audio_in_sample_rate=8000)
    )
    _, finals, _ = stt_results(down)
    assert misheard(finals[0].text, QUESTION) <= 1


async def test_stt_forwards_interruptions_and_keeps_listening(whisper):
    stt = StreamingWhisperSTTService(model=whisper, cfg=ASRConfig())
    send = [
        VADUserStartedSpeakingFrame(),
        *audio_frames(speech(QUESTION)[:8000]),
        InterruptionFrame(),  # barge-in: the caller is still speaking
        *audio_frames(speech(QUESTION)[8000:]),
        *audio_frames(silence(0.5)),
        VADUserStoppedSpeakingFrame(stop_secs=0.5),
    ]
    down, _ = await run_test(stt, frames_to_send=send)
    _, finals, _ = stt_results(down)
    assert sum(isinstance(f, InterruptionFrame) for f in down) == 1
    assert misheard(finals[0].text, QUESTION) <= 1


# TTS


class FirstAudioObserver(BaseObserver):
    """Wall-clock times: each text frame reaching the TTS, the first audio leaving it."""

    def __init__(self, tts):
        super().__init__()
        self.tts = tts
        self.text_in: dict[str, float] = {}
        self.first_audio: float | None = None

    async def on_push_frame(self, data: FramePushed):
        if data.destination is self.tts and isinstance(data.frame, (LLMTextFrame, TTSSpeakFrame)):
            self.text_in.setdefault(data.frame.text, time.perf_counter())
        if (data.source is self.tts and isinstance(data.frame, TTSAudioRawFrame)
                and self.first_audio is None):
            self.first_audio = time.perf_counter()


@pytest.fixture(scope="module")
def voice():
    return load_tts_voice(TTSConfig())


@pytest.fixture
def tts(voice):
    return make_tts(TTSConfig(), voice)  # a processor serves one pipeline: a fresh one per test


async def test_tts_speaks_the_first_clause_before_the_rest_of_the_reply_exists(tts):
    observer = FirstAudioObserver(tts)
    first, rest = "Paris is the capital of France, ", " it has many museums."
    send = [
        LLMFullResponseStartFrame(),
        LLMTextFrame(first),
        LLMTextFrame("and"),
        SleepFrame(2.0),  # the LLM is slow to continue
        LLMTextFrame(rest),
        LLMFullResponseEndFrame(),
    ]
    down, _ = await run_test(tts, frames_to_send=send, observers=[observer])
    assert observer.first_audio is not None
    assert observer.first_audio < observer.text_in[rest]
    print(f"TTS first chunk: {(observer.first_audio - observer.text_in[first]) * 1000:.0f} ms")
    spoken = [f.text for f in down if isinstance(f, TTSTextFrame)]
    assert spoken == ["Paris is the capital of France,", "and it has many museums."]


@pytest.mark.parametrize("rate", [8000, 16000])
async def test_tts_audio_is_resampled_to_the_output_rate(tts, rate):
    # Piper draws random phoneme durations; without that noise its output length is exact.
    tts._syn_config = SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0)
    text = "Hello there, how are you today?"
    send = [TTSSpeakFrame(text)]
    down, _ = await run_test(
        tts, frames_to_send=send, pipeline_params=PipelineParams(audio_out_sample_rate=rate)
    )
    audio = [f for f in down if isinstance(f, TTSAudioRawFrame)]
    assert audio and all(f.sample_rate == rate and f.num_channels == 1 for f in audio)
    kinds = [type(f) for f in down]
    assert kinds.index(TTSStartedFrame) < kinds.index(TTSAudioRawFrame)
    assert kinds.index(TTSStoppedFrame) > down.index(audio[-1])
    assert len(audio) >= 2  # one sentence, two clauses: synthesised one after the other
    seconds = sum(len(f.audio) for f in audio) / 2 / rate
    voice = tts._voice
    expected = sum(len(c.audio_int16_array) for clause in ("Hello there,", "how are you today?")
                   for c in voice.synthesize(clause, syn_config=tts._syn_config))
    expected /= voice.config.sample_rate
    assert abs(seconds - expected) < 0.02  # the same speech at the new rate, none of it lost
    pcm = np.frombuffer(b"".join(f.audio for f in audio), np.int16)
    assert np.sqrt(np.mean(pcm.astype(np.float64) ** 2)) > 1000  # real speech energy


async def test_tts_interruption_drops_the_rest_of_the_reply(tts):
    # Long enough that synthesis (tens of times faster than real time) is far from done at the cut.
    clauses = [f"This is clause number {n}, which keeps going for a while," for n in range(60)]
    send = [
        LLMFullResponseStartFrame(),
        *[LLMTextFrame(c + " ") for c in clauses],
    ]
    observer = FirstAudioObserver(tts)

    def frames():
        yield from send
        # The cut comes once audio flows, however long a loaded machine takes to start it.
        deadline = time.perf_counter() + 30
        while observer.first_audio is None and time.perf_counter() < deadline:
            yield SleepFrame(0.05)
        yield from (SleepFrame(0.2), InterruptionFrame(), SleepFrame(1.0),
                    LLMFullResponseEndFrame())

    down, _ = await run_test(tts, frames_to_send=frames(), observers=[observer])
    cut = next(i for i, f in enumerate(down) if isinstance(f, InterruptionFrame))
    before = [f for f in down[:cut] if isinstance(f, TTSAudioRawFrame)]
    after = [f for f in down[cut:] if isinstance(f, TTSAudioRawFrame)]
    assert before, "nothing was spoken before the interruption"
    assert not after, "audio kept coming after the interruption"
    spoken = sum(len(f.audio) for f in before) / 2 / 24000
    assert spoken < 60 * 3.0 / 2  # far less than the whole reply (about 3 s a clause)


async def test_an_interim_queued_behind_other_calls_work_gives_way_to_the_final(whisper):
    worker = SpeechWorker("asr-test")
    gate, ran = threading.Event(), []
    interim = StreamingTranscriber.interim

    def counted(self):
        ran.append("interim")
        return interim(self)

    # Another call's long pass holds the worker; this call's interims queue behind it.
    other = asyncio.ensure_future(worker.run(gate.wait, 10, priority=CRITICAL))
    stt = StreamingWhisperSTTService(model=whisper, cfg=ASRConfig(interim_every_ms=300),
                                     worker=worker)
    send = [
        VADUserStartedSpeakingFrame(),
        *audio_frames(speech(QUESTION)),
        VADUserStoppedSpeakingFrame(stop_secs=0.2),
        SleepFrame(0.2),
    ]
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(StreamingTranscriber, "interim", counted)
            asyncio.get_running_loop().call_later(1.0, gate.set)
            down, _ = await run_test(stt, frames_to_send=send)
        await other
    finally:
        worker.close()
    _, finals, metrics = stt_results(down)
    assert misheard(finals[0].text, QUESTION) <= 1
    assert not metrics[0].reused_interim and ran == []  # the queued interim never ran


async def test_a_reply_is_prepared_on_the_cut_run_while_the_padded_run_settles_digits(whisper):
    """With `digits_padded`: at a pause, an utterance holding digits is reported from the cheap
    cut run at once, and the padded run it owes (audio.whisper_window) comes after that, not
    before it."""

    order: list[str] = []
    padded = asr.transcribe_padded

    def spied_padded(*args, **kwargs):
        order.append("padded")
        return padded(*args, **kwargs)

    async def spied_eager(self, text, **kwargs):
        order.append(f"eager: {text}")

    stt = StreamingWhisperSTTService(
        model=whisper, cfg=ASRConfig(interim_every_ms=60_000, digits_padded=True), prepare=True)
    send = [
        VADUserStartedSpeakingFrame(),
        *audio_frames(speech("The order number is four eight two one three.")),
        *audio_frames(silence(0.1)),
        UserSpeechPausedFrame(),
        SleepFrame(3.0),  # both runs finish before the stop
        VADUserStoppedSpeakingFrame(stop_secs=0.1),
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(asr, "transcribe_padded", spied_padded)
        patch.setattr(StreamingWhisperSTTService, "_push_eager_end_of_turn", spied_eager)
        down, _ = await run_test(stt, frames_to_send=send)
    _, finals, metrics = stt_results(down)
    assert order[0].startswith("eager: ") and any(c.isdigit() for c in order[0]), order
    assert order[1] == "padded" and order.count("padded") == 1, order
    assert metrics[0].reused_interim  # the final is the pause's padded run
    assert any(c.isdigit() for c in finals[0].text)


@pytest.mark.parametrize("pause_interim", [True, False])
async def test_a_recent_finished_interim_starts_the_reply_before_the_pause_transcript(
        whisper, pause_interim):
    """With `pause_interim`: at a pause, an interim that heard all but the last ~100 ms and ends a
    sentence goes out as the eager transcript before the pause's own run, which then only
    confirms it; without, the eager transcript waits for that run."""
    order: list[str] = []
    interim = StreamingTranscriber.interim

    def spied_interim(self, *args, **kwargs):
        order.append("run")
        return interim(self, *args, **kwargs)

    async def spied_eager(self, text, **kwargs):
        order.append(f"eager: {text}")

    question = speech(QUESTION)
    every_ms = len(question) // 320 * 20  # one interim, due at the speech's last whole frame
    stt = StreamingWhisperSTTService(
        model=whisper, cfg=ASRConfig(interim_every_ms=every_ms, pause_interim=pause_interim),
        prepare=True)
    send = [
        VADUserStartedSpeakingFrame(),
        *audio_frames(question),
        SleepFrame(1.0),  # the interim takes its audio before the silence comes
        *audio_frames(silence(0.1)),
        UserSpeechPausedFrame(),
        SleepFrame(2.0),
        VADUserStoppedSpeakingFrame(stop_secs=0.1),
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StreamingTranscriber, "interim", spied_interim)
        patch.setattr(StreamingWhisperSTTService, "_push_eager_end_of_turn", spied_eager)
        down, _ = await run_test(stt, frames_to_send=send)
    _, finals, metrics = stt_results(down)
    first = next(o for o in order if o.startswith("eager: "))
    assert misheard(first[len("eager: "):], QUESTION) <= 1, order
    expected = ["run", first, "run"] if pause_interim else ["run", "run", first]
    assert order[:3] == expected
    assert metrics[0].reused_interim  # the final is the pause's run
    # The pause's run confirms the guess unless it heard other words (then it prepares again).
    assert len(order) == 3 or not _same_words(first[len("eager: "):], finals[0].text), order


async def test_a_replys_first_phrase_holds_its_calls_engine_requests_while_synthesised(voice):
    """Only the first phrase of a reply holds the call's engine requests, and the hold ends when
    that phrase's audio is out."""
    holds: list[tuple[threading.Event, float]] = []
    released_at_synthesis: list[bool] = []

    class SpiedVoice:  # each clause's synthesis sees whether the holds so far have ended
        config = voice.config

        def synthesize(self, text, **kwargs):
            released_at_synthesis.append(all(until.is_set() for until, _ in holds))
            return voice.synthesize(text, **kwargs)

    tts = make_tts(TTSConfig(first_phrase_hold_s=0.4), SpiedVoice(),
                   hold_engine=lambda until, max_s: holds.append((until, max_s)))
    send = [
        LLMFullResponseStartFrame(),
        LLMTextFrame("Paris is the capital of France, "),
        LLMTextFrame("and it has many museums. "),
        LLMTextFrame("It is lovely in the spring."),
        LLMFullResponseEndFrame(),
    ]
    down, _ = await run_test(tts, frames_to_send=send)
    assert len([f for f in down if isinstance(f, TTSTextFrame)]) == 3
    [(until, max_s)] = holds
    assert max_s == 0.4 and until.is_set()
    # released before the second phrase
    assert len(released_at_synthesis) >= 3 and all(released_at_synthesis[1:])


# 2.7 s: the third clause (about 4 s of audio in) waits about 1.3 s, inside the one wait's cap
@pytest.mark.parametrize("lead_s", [2.7, 0.0])
async def test_a_replys_later_phrases_are_synthesised_as_its_playback_needs_them(voice, lead_s):
    """With `tts.lead_s`, each phrase after the first waits until the audio before it runs at
    most that far ahead of real-time playback from the first chunk; with 0, none waits."""
    starts: list[float] = []

    class SpiedVoice:  # when each clause's synthesis begins
        config = voice.config

        def synthesize(self, text, **kwargs):
            starts.append(time.monotonic())
            return voice.synthesize(text, **kwargs)

    tts = make_tts(TTSConfig(lead_s=lead_s), SpiedVoice())
    tts._syn_config = SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0)  # exact lengths
    clauses = ["Paris is the capital of France,", "and it has many lovely museums,",
               "and the people are very kind."]
    send = [LLMFullResponseStartFrame(), *[LLMTextFrame(c + " ") for c in clauses],
            LLMFullResponseEndFrame()]
    first_audio: list[float] = []

    class FirstChunk(BaseObserver):
        async def on_push_frame(self, data: FramePushed):
            if data.source is tts and isinstance(data.frame, TTSAudioRawFrame):
                first_audio.append(time.monotonic())

    down, _ = await run_test(tts, frames_to_send=send, observers=[FirstChunk()])
    assert [f.text for f in down if isinstance(f, TTSTextFrame)] == clauses
    assert len(starts) == 3
    # Playback reaches the third clause's audio once the first two have played.
    audio_before = sum(len(chunk.audio_int16_array) for clause in clauses[:2]
                       for chunk in voice.synthesize(clause, syn_config=tts._syn_config))
    audio_before /= voice.config.sample_rate
    due = first_audio[0] + audio_before - lead_s
    if lead_s:  # not synthesised sooner than lead_s before that
        assert starts[2] >= due - 0.05, (starts[2] - first_audio[0], audio_before)
    else:  # as fast as Piper goes: long before playback would need it
        assert starts[2] < due - 1.0, (starts[2] - first_audio[0], audio_before)


async def test_a_reply_is_an_opening_from_its_start_to_its_first_audio(voice):
    openings, open_at_synthesis = Openings(), []

    class SpiedVoice:  # each clause's synthesis sees whether a reply is still opening
        config = voice.config

        def synthesize(self, text, **kwargs):
            open_at_synthesis.append(openings.any())
            return voice.synthesize(text, **kwargs)

    tts = make_tts(TTSConfig(), SpiedVoice(), openings=openings)
    send = [LLMFullResponseStartFrame(), LLMTextFrame("Paris is the capital of France, "),
            LLMTextFrame("and it has many museums."), LLMFullResponseEndFrame()]
    await run_test(tts, frames_to_send=send)
    assert open_at_synthesis[0] and len(open_at_synthesis) >= 2
    assert not any(open_at_synthesis[1:])  # closed once the first phrase's audio was out


class _Logged(Openings):
    def __init__(self, log: list[str]):
        super().__init__()
        self.log = log

    def open(self, reply):
        self.log.append("open")
        super().open(reply)

    def close(self, reply):
        self.log.append("close")
        super().close(reply)


@pytest.mark.parametrize("send", [
    [LLMFullResponseStartFrame(), LLMFullResponseEndFrame()],  # a tool call: no text
    [LLMFullResponseStartFrame(), LLMTextFrame("  "), LLMFullResponseEndFrame()],  # no words
    # a barge-in before any audio (a system frame: it would overtake the start unless later)
    [LLMFullResponseStartFrame(), SleepFrame(0.2), InterruptionFrame()],
], ids=["no-text", "blank-text", "interrupted"])
async def test_a_reply_that_will_not_be_heard_closes_its_opening(voice, send):
    log: list[str] = []
    openings = _Logged(log)
    tts = make_tts(TTSConfig(), voice, openings=openings)
    await run_test(tts, frames_to_send=send)
    assert log[:2] == ["open", "close"] and not openings.any()


@pytest.mark.parametrize("hold_s,send", [
    (0.0, [LLMFullResponseStartFrame(), LLMTextFrame("Hello there, how are you today?"),
           LLMFullResponseEndFrame()]),  # off
    (0.3, [TTSSpeakFrame("Hello there, how are you today?")]),  # no reply decodes beside it
])
async def test_no_engine_hold_when_off_or_for_spoken_text(voice, hold_s, send):
    holds = []
    tts = make_tts(TTSConfig(first_phrase_hold_s=hold_s), voice,
                   hold_engine=lambda until, max_s: holds.append(until))
    down, _ = await run_test(tts, frames_to_send=send)
    assert any(isinstance(f, TTSAudioRawFrame) for f in down)
    assert holds == []
