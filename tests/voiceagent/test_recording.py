"""Call recording (`store.audio`): off by default, a two-channel WAV per call on the call's own
timeline when on, served only behind the dashboard's token, deleted by the store's retention."""

from __future__ import annotations

import io
import os
import time

import httpx
import numpy as np
import pytest
import soundfile
from pipecat.frames.frames import InputAudioRawFrame, OutputAudioRawFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.tests.utils import SleepFrame, run_test

from tests.audio.speech import silence, speech
from tests.voiceagent.serving import server_config, serving, twilio_url, until
from tests.voiceagent.turns import make_turn
from voiceagent.cli import main
from voiceagent.config import load_config
from voiceagent.dashboard.stats import recording_marks
from voiceagent.dashboard.store import open_store
from voiceagent.pipeline.recording import (
    call_recorder,
    prune_recordings,
    recording_path,
    recordings_dir,
    started_at,
)
from voiceagent.server.app import create_app
from voiceagent.sim.call import RATE, simulate_call
from voiceagent.sim.twilio_caller import TwilioCaller

FRAME_MS = 20  # one transport frame


def _onset(x: np.ndarray) -> int:
    """The first sample that is sound, not silence or a resampler's +-1 ripple."""
    return int(np.argmax(np.abs(x.astype(np.int32)) > 300))


async def test_a_recorded_call_lines_up_with_the_call_and_its_clocks(models, tmp_path):
    cfg = load_config(None, [f"paths.runs_dir={tmp_path}", "store.audio=true"])
    caller = np.concatenate([silence(0.5), speech("What is the capital of France?"),
                             silence(4.0)])
    store = open_store(cfg)
    try:
        result = await simulate_call(cfg, models, caller, store=store)
    finally:
        store.close()
    [turn] = result.turns
    path = recording_path(recordings_dir(cfg), result.call_id)
    stereo, rate = soundfile.read(path, dtype="int16")
    assert stereo.ndim == 2 and stereo.shape[1] == 2
    left, right = stereo[:, 0], stereo[:, 1]

    def ms(at: int, of_rate: int) -> float:
        return at * 1000 / of_rate

    # The caller's channel is the caller's audio; the bot's starts where the call heard it.
    caller_lag = ms(_onset(left), rate) - ms(_onset(caller), RATE)
    bot_lag = ms(_onset(right), rate) - ms(_onset(result.bot), RATE)
    # ... which is where the stored clocks put it: the caller's speech, then clock 3.
    turn_end_ms = ms(_onset(left), rate) + turn.breakdown.user_speech_ms
    heard_ms = ms(_onset(right), rate) - turn_end_ms
    clock3 = turn.clocks.turn_end_to_first_audio_ms
    # The turn's wall-clock start is where the caller's speech starts on the recording.
    start_lag = (turn.started_at - started_at(path)) * 1000 - ms(_onset(left), rate)
    print(f"recording at {rate} Hz: caller {caller_lag:+.1f} ms, bot {bot_lag:+.1f} ms, first "
          f"audio {heard_ms:.1f} ms after the speech against clock 3 {clock3:.1f} ms, turn "
          f"start {start_lag:+.1f} ms")
    assert abs(caller_lag) <= FRAME_MS and abs(bot_lag) <= FRAME_MS
    # The bot's sound starts after the first audio frame that clock 3 stops at, by Piper's
    # leading silence (~60 ms); the caller's onset and the VAD's start differ by under a frame.
    assert -FRAME_MS <= heard_ms - clock3 <= 4 * FRAME_MS
    assert abs(start_lag) <= 2 * FRAME_MS

    # `voiceagent report --turn` draws the same turn from the same recording.
    out = tmp_path / "report.md"
    assert main(["report", "--out", str(out), "--turn", f"{result.call_id}:1",
                 "--set", f"paths.runs_dir={tmp_path}"]) == 0
    png = tmp_path / "report_files" / f"turn-{result.call_id}-1.png"
    assert f"report_files/turn-{result.call_id}-1.png" in out.read_text()
    assert png.stat().st_size > 10_000
    assert main(["report", "--out", str(out), "--turn", f"{result.call_id}:7",
                 "--set", f"paths.runs_dir={tmp_path}"]) == 2  # no such turn: a clear error


async def test_an_unrecorded_call_leaves_no_audio_file(models, tmp_path):
    cfg = load_config(None, [f"paths.runs_dir={tmp_path}"])
    assert cfg.store.audio is False  # the default
    await simulate_call(cfg, models, np.concatenate([silence(0.5), speech("Hello."),
                                                     silence(3.0)]))
    assert not recordings_dir(cfg).exists() or not any(recordings_dir(cfg).iterdir())


async def test_a_phone_call_on_the_server_is_recorded_and_served_with_the_token(models, tmp_path):
    cfg = server_config(tmp_path, "store.audio=true", "server.token=s3cret")
    async with serving(cfg, models) as (app, base):
        async with TwilioCaller(twilio_url(base), token="s3cret") as caller:
            await caller.start()
            said = await caller.say(speech("What is the capital of France?"))
            assert await caller.reply(said.ended, 45) is not None
            await caller.hang_up()
        assert await until(lambda: not app.state.server.calls.active, 15)
        [call_id] = [p.stem for p in recordings_dir(cfg).glob("*.wav")]
        async with httpx.AsyncClient(base_url=base) as http:
            served = await http.get(f"/api/calls/{call_id}/audio",
                                    headers={"Authorization": "Bearer s3cret"})
    assert float(served.headers["x-recording-started-at"]) > time.time() - 120
    stereo, rate = soundfile.read(io.BytesIO(served.content), dtype="int16")
    assert rate == 8000 and stereo.shape[1] == 2  # the phone line's rate, both sides
    assert np.abs(stereo[:, 0]).max() > 1000  # the caller spoke
    assert np.abs(stereo[:, 1]).max() > 1000  # the bot answered before the hang-up


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")


async def test_a_recording_is_served_only_with_the_token_and_never_for_a_stranger_path(tmp_path):
    cfg = server_config(tmp_path, "server.token=s3cret", "store.audio=true")
    folder = recordings_dir(cfg)
    folder.mkdir(parents=True)
    (folder / "abc123.wav").write_bytes(b"RIFF....WAVE")
    token = {"Authorization": "Bearer s3cret"}
    async with _client(create_app(cfg)) as http:
        assert (await http.get("/api/calls/abc123/audio")).status_code == 401
        served = await http.get("/api/calls/abc123/audio", headers=token)
        assert served.status_code == 200 and served.headers["content-type"] == "audio/wav"
        assert (await http.get("/api/calls/nope/audio", headers=token)).status_code == 404
        assert (await http.get("/api/calls/..%2Fturns/audio", headers=token)).status_code == 404


def test_retention_deletes_a_recording_with_its_call(tmp_path):
    cfg = server_config(tmp_path, "store.retention_days=30")
    folder = recordings_dir(cfg)
    folder.mkdir(parents=True)
    old, new = folder / "old.wav", folder / "new.wav"
    for path in (old, new):
        path.write_bytes(b"RIFF")
    days_ago = time.time() - 40 * 86400
    os.utime(old, (days_ago, days_ago))
    assert prune_recordings(folder, time.time() - 30 * 86400) == 1
    assert not old.exists() and new.exists()
    os.utime(new, (days_ago, days_ago))
    store = open_store(cfg)  # retention runs as its writer starts
    try:
        deadline = time.monotonic() + 30  # the writer thread starts late on a loaded machine
        while new.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not new.exists()
    finally:
        store.close()


def test_the_marks_are_each_turns_stages_on_the_recordings_clock():
    first, second = make_turn("c", 1, started_at=1010.0), make_turn("c", 2, started_at=1013.5)
    first.interrupted = True  # the second turn started over its reply
    b, clock3 = first.breakdown, first.clocks.turn_end_to_first_audio_ms
    marks = recording_marks([first.to_dict(), second.to_dict()], started_at=1000.0)
    want = [(1, "speech end", 10 + b.user_speech_ms / 1000),
            (1, "hangover", 10 + (b.user_speech_ms + b.vad_hangover_ms) / 1000),
            (1, "first audio", 10 + (b.user_speech_ms + clock3) / 1000),
            (1, "barge-in", 13.5)]
    got = [(m["turn"], m["mark"], m["s"]) for m in marks if m["turn"] == 1]
    assert [(t, name) for t, name, _ in got] == [(t, name) for t, name, _ in want]
    assert [s for *_, s in got] == pytest.approx([s for *_, s in want])
    assert [m["mark"] for m in marks if m["turn"] == 2] == ["speech end", "hangover",
                                                            "first audio"]



async def test_the_timeline_starts_with_the_callers_first_frame_not_the_pipelines_start(tmp_path):
    """The caller's track is laid by count from the timeline's 0, so that 0 is the caller's first
    frame: a line whose audio starts after the pipeline's (a slow start, a late media stream)
    must not shift the bot's audio against it."""
    recorder = call_recorder(tmp_path, "late")
    caller = InputAudioRawFrame(audio=bytes(640), sample_rate=16000, num_channels=1)
    bot = OutputAudioRawFrame(audio=np.full(320, 5000, np.int16).tobytes(), sample_rate=16000,
                              num_channels=1)
    # The caller's first frame comes 0.2 s after the start; the bot plays 0.3 s after it.
    await run_test(Pipeline([recorder.front(), recorder]), expected_down_frames=None,
                   frames_to_send=[SleepFrame(0.2), caller, SleepFrame(0.3), bot])
    stereo, rate = soundfile.read(recording_path(tmp_path, "late"), dtype="int16")
    at_ms = _onset(stereo[:, 1]) * 1000 / rate
    assert 280 <= at_ms <= 400, at_ms
