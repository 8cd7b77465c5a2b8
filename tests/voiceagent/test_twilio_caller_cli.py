"""`python -m voiceagent.sim.twilio_caller URL WAV`: the simulated Twilio caller from a shell,
against the real server: its help, a call's summary, a refused call."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from audio.wav import read_wav, write_wav
from tests.audio.speech import speech
from tests.voiceagent.server_proc import REPO
from tests.voiceagent.serving import server_config, serving, twilio_url
from tests.voiceagent.tiny_shared import tiny_shared

MODULE = [sys.executable, "-m", "voiceagent.sim.twilio_caller"]


async def _caller(*args: str) -> tuple[int, str, str]:
    """The caller as its own process, while this event loop serves the call."""
    proc = await asyncio.create_subprocess_exec(
        *MODULE, *args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode, out.decode(), err.decode()


def test_help_describes_the_caller_and_its_flags():
    done = subprocess.run([*MODULE, "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0
    assert done.stdout.startswith("usage: python -m voiceagent.sim.twilio_caller")
    for flag in ("url", "wav", "--token", "--twilio-auth-token", "--out", "--json"):
        assert flag in done.stdout


async def test_a_call_prints_its_reply_marks_and_what_the_caller_heard(tmp_path, models):
    question = tmp_path / "question.wav"
    write_wav(question, speech("What is the capital of France?"), 16000)
    heard = tmp_path / "heard.wav"
    async with serving(server_config(tmp_path), models) as (_app, base):
        code, out, err = await _caller(twilio_url(base), str(question), "--json",
                                       "--out", str(heard))
    assert code == 0, err
    call = json.loads(out)
    [turn] = call["turns"]
    assert turn["wav"] == str(question) and turn["reply_after_ms"] > 0
    assert turn["reply_audio_s"] > 0.5 and call["heard_s"] >= turn["reply_audio_s"]
    assert [m["name"] for m in call["marks"]][:1] == ["bot-1"]
    assert len(read_wav(heard, 8000)) >= call["heard_s"] * 8000 * 0.99


async def test_a_refused_call_exits_1_and_says_why(tmp_path):
    question = tmp_path / "question.wav"
    write_wav(question, speech("Hello?"), 16000)
    shared = tiny_shared()
    try:
        async with serving(server_config(tmp_path, "server.token=s3cret"), shared) as (_, base):
            code, out, _err = await _caller(twilio_url(base), str(question), "--lead-in", "0")
    finally:
        shared.close()
    assert code == 1
    assert "no reply" in out
    assert out.strip().splitlines()[-1] == "closed: 1008 unauthorized: missing or wrong token"
