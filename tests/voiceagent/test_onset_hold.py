"""OnsetHold in pipecat's run_test harness, and the VAD frames it hears, on synthesised speech."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from pipecat.frames.frames import (
    AudioBufferStartRecordingFrame,
    EndFrame,
    InputAudioRawFrame,
    InterruptionFrame,
    TTSAudioRawFrame,
    TTSTextFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.tests.utils import SleepFrame, run_test

from audio.config import VADConfig
from audio.wav import frames
from tests.audio.speech import silence, speech
from voiceagent.pipeline.frames import (
    UserSpeechOnsetFrame,
    UserSpeechPausedFrame,
    UserVoiceFellFrame,
    UserVoiceRisingFrame,
)
from voiceagent.pipeline.onset_hold import OnsetHold
from voiceagent.pipeline.vad import PausingVADProcessor, load_vad_model, make_vad

RATE = 16000


def _audio(seconds: float = 0.25) -> TTSAudioRawFrame:
    return TTSAudioRawFrame(audio=bytes(2 * int(RATE * seconds)), sample_rate=RATE,
                            num_channels=1, context_id="c")


def _marker() -> UserSpeechOnsetFrame:
    """A system frame: it passes at once, so frames before it in the output were not held."""
    return UserSpeechOnsetFrame(onset_ns=0)


async def _run(frames_to_send, max_hold_s: float = 5.0, **kwargs) -> list:
    down, _ = await asyncio.wait_for(
        run_test(OnsetHold(max_hold_s), frames_to_send=frames_to_send, **kwargs), 30)
    return [type(f) for f in down]


async def test_the_bot_does_not_start_while_the_callers_voice_rises_and_plays_when_it_falls():
    down = await _run([UserVoiceRisingFrame(), _audio(), _audio(), SleepFrame(0.1), _marker(),
                       UserVoiceFellFrame()])
    assert TTSAudioRawFrame not in down[:down.index(UserSpeechOnsetFrame)]  # it waited
    assert down.count(TTSAudioRawFrame) == 2  # then all of it played, in order


async def test_speech_that_interrupts_drops_the_held_reply_but_not_an_uninterruptible_frame():
    down = await _run([UserVoiceRisingFrame(), _audio(), AudioBufferStartRecordingFrame(),
                       TTSTextFrame("The", "word", context_id="c"), SleepFrame(0.1),
                       VADUserStartedSpeakingFrame(), InterruptionFrame(),
                       UserSpeechPausedFrame()])
    assert TTSAudioRawFrame not in down and TTSTextFrame not in down
    assert AudioBufferStartRecordingFrame in down  # pipecat's queues keep it, and so do we


async def test_audio_already_playing_goes_on_over_the_callers_voice():
    down = await _run([_audio(1.0), SleepFrame(0.05), UserVoiceRisingFrame(), _audio(),
                       SleepFrame(0.1),
                       _marker()])
    assert down[:down.index(UserSpeechOnsetFrame)].count(TTSAudioRawFrame) == 2


async def test_a_silent_line_lets_the_reply_start_at_once():
    down = await _run([UserVoiceRisingFrame(), UserVoiceFellFrame(), _audio(), SleepFrame(0.1),
                       _marker()])
    assert TTSAudioRawFrame in down[:down.index(UserSpeechOnsetFrame)]


async def test_a_voice_that_never_resolves_holds_the_bot_no_longer_than_the_bound():
    down = await _run([UserVoiceRisingFrame(), _audio(), SleepFrame(0.5), _marker()],
                      max_hold_s=0.2)
    assert TTSAudioRawFrame in down[:down.index(UserSpeechOnsetFrame)]  # out after 0.2 s
    down = await _run([UserVoiceRisingFrame(), _audio(), SleepFrame(0.1), _marker()],
                      max_hold_s=0.5)
    assert TTSAudioRawFrame not in down[:down.index(UserSpeechOnsetFrame)]  # not before it


async def test_confirmed_speech_holds_the_bot_until_it_pauses():
    down = await _run([VADUserStartedSpeakingFrame(), _audio(), SleepFrame(0.1), _marker(),
                       UserSpeechPausedFrame()])
    assert TTSAudioRawFrame not in down[:down.index(UserSpeechOnsetFrame)]
    assert TTSAudioRawFrame in down


async def test_the_end_of_the_call_lets_the_held_reply_out_first():
    down = await _run([UserVoiceRisingFrame(), _audio(), EndFrame()], send_end_frame=False)
    assert down.index(TTSAudioRawFrame) < down.index(EndFrame)


# The VAD frames, from Silero on synthesised speech


@pytest.fixture(scope="module")
def vad_model():
    return load_vad_model(VADConfig())


async def _vad_frames(vad_model, samples: np.ndarray) -> list:
    """The frames out of the VAD, each 20 ms audio frame as the class InputAudioRawFrame."""
    vad = PausingVADProcessor(vad_analyzer=make_vad(VADConfig(), vad_model))
    send = [InputAudioRawFrame(c.tobytes(), RATE, 1) for c in frames(samples, RATE)]
    down, _ = await asyncio.wait_for(run_test(vad, frames_to_send=send), 60)
    return [type(f) for f in down]


def _ms_at(down: list, frame_type) -> int:
    """The audio received before `frame_type` came out, in ms."""
    return 20 * down[:down.index(frame_type)].count(InputAudioRawFrame)


async def test_the_voice_rises_at_the_first_word_before_the_vad_confirms_speech(vad_model):
    words = speech("What is the capital of France?")
    onset_ms = 500 + 1000 * np.flatnonzero(np.abs(words) > 1000)[0] // RATE
    audio = np.concatenate([silence(0.5), words, silence(1.0)])
    down = await _vad_frames(vad_model, audio)
    # Silero's windows are 32 ms: the first confident one, not the smoothed volume the VAD's
    # own start waits for (~150 ms later)
    assert -40 <= _ms_at(down, UserVoiceRisingFrame) - onset_ms <= 100  # not in the silence
    assert _ms_at(down, UserVoiceRisingFrame) < _ms_at(down, VADUserStartedSpeakingFrame)
    assert UserVoiceFellFrame not in down[:down.index(VADUserStartedSpeakingFrame)]


async def test_a_voiced_blip_too_short_for_speech_rises_and_falls(vad_model):
    word = speech("Yes.")
    voiced = np.flatnonzero(np.abs(word) > 1000)
    blip = word[voiced[0]:voiced[0] + int(0.08 * RATE)]  # 80 ms: under start_secs (0.2 s)
    down = await _vad_frames(vad_model, np.concatenate([silence(0.5), blip, silence(0.5)]))
    assert VADUserStartedSpeakingFrame not in down
    assert UserVoiceRisingFrame in down
    assert down.index(UserVoiceRisingFrame) < down.index(UserVoiceFellFrame)


class _ConfidentOnSound:
    """Silero stand-in: confident of every window with any sound, so a quiet murmur is voiced
    while the VAD's volume gate keeps it from being speech."""

    def __call__(self, audio, sample_rate):
        return np.array([0.99 if np.abs(audio).max() > 0 else 0.0], np.float32)

    def reset_states(self):
        pass


def _tone(seconds: float, amplitude: int) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (amplitude * np.sin(2 * np.pi * 220 * t)).astype(np.int16)


async def test_a_voice_still_murmuring_when_speech_stops_rises_again(vad_model):
    analyzer = make_vad(VADConfig(), vad_model)
    analyzer._model = _ConfidentOnSound()
    vad = PausingVADProcessor(vad_analyzer=analyzer)
    audio = np.concatenate([silence(0.3), _tone(0.8, 12000), _tone(1.5, 60)])
    send = [InputAudioRawFrame(c.tobytes(), RATE, 1) for c in frames(audio, RATE)]
    down, _ = await asyncio.wait_for(run_test(vad, frames_to_send=send), 60)
    kinds = [type(f) for f in down]
    stop = kinds.index(VADUserStoppedSpeakingFrame)
    assert UserVoiceRisingFrame in kinds[stop:]  # the murmur after the stop may be speech
