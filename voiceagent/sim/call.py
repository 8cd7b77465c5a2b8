"""`voiceagent call`: a simulated phone call from a WAV file through the real pipeline.

The caller's audio streams in as 20 ms frames (real time by default); the bot's audio is placed on
the same timeline, so OUT.wav (left: caller, right: bot) lets you hear overlap and barge-in.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pipecat.frames.frames import EndFrame
from pipecat.workers.runner import WorkerRunner

from audio.wav import read_wav, write_wav
from voiceagent import logs
from voiceagent.config import Config, config_hash
from voiceagent.dashboard.store import CallInfo, open_store
from voiceagent.figures import fmt
from voiceagent.pipeline.builder import SharedModels, build_call, load_shared
from voiceagent.pipeline.records import JsonlTurnSink, TurnRecords
from voiceagent.pipeline.turn_record import TurnRecord
from voiceagent.pipeline.wav_transport import WavCallTransport

RATE = 16000  # the simulated line's rate, in and out
QUIET_S = 1.5  # after the caller's audio, hang up once the bot has been idle this long
MAX_WAIT_S = 60.0  # ... or at the latest this long after the caller's audio ended


@dataclass
class CallResult:
    call_id: str
    turns: list[TurnRecord]
    caller: np.ndarray  # int16 at RATE
    bot: np.ndarray  # int16 at RATE, on the caller's timeline
    jsonl: Path
    messages: list[dict]  # the conversation context at hang-up


async def simulate_call(
    cfg: Config,
    shared: SharedModels,
    audio: np.ndarray,
    realtime: bool = True,
    method: str | None = None,
) -> CallResult:
    """Run one call with `audio` (int16 mono at RATE) as the caller; return its turns."""
    transport = WavCallTransport(audio, RATE, RATE, realtime=realtime)
    sink = JsonlTurnSink(cfg.paths.runs_dir)
    store = open_store(cfg)
    records = TurnRecords([sink, store])
    call = build_call(cfg, shared, transport, records.add, method=method)
    store.start_call(CallInfo(
        call.call_id, "simulated", time.time(), method or shared.chat.name,
        config_hash(cfg), shared.llm.card.card_hash if shared.llm else None,
    ))
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(call.task)
    run = asyncio.create_task(runner.run())
    try:
        await _wait_for_end(transport, call.clocks, run)
        await call.task.queue_frame(EndFrame())
        await asyncio.wait_for(run, 30)
    finally:
        if not run.done():
            await call.task.cancel()
        call.clocks.flush()
        store.end_call(call.call_id, time.time())
        records.close()
    seconds = max(len(audio) / RATE, transport.clock.now())
    bot = transport.output().timeline(seconds)
    return CallResult(
        call.call_id, records.by_call.get(call.call_id, []), audio, bot,
        sink.path_for(call.call_id), list(call.context.get_messages()),
    )


async def _wait_for_end(transport: WavCallTransport, clocks, run: asyncio.Task) -> None:
    await asyncio.wait(
        [asyncio.ensure_future(transport.input().audio_done.wait()), run],
        return_when=asyncio.FIRST_COMPLETED,
    )
    deadline = time.monotonic() + MAX_WAIT_S
    quiet_since = None
    while time.monotonic() < deadline and not run.done():
        if clocks.idle:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since >= QUIET_S:
                return
        else:
            quiet_since = None
        await asyncio.sleep(0.05)


def write_call_wav(path: str | Path, result: CallResult) -> None:
    n = max(len(result.caller), len(result.bot))
    stereo = np.zeros((n, 2), dtype=np.int16)
    stereo[: len(result.caller), 0] = result.caller
    stereo[: len(result.bot), 1] = result.bot
    write_wav(path, stereo, RATE)


def _fmt(ms) -> str:
    return fmt(ms, 0, " ms")


def print_turns(result: CallResult) -> None:
    if not result.turns:
        print("no turns: the caller's audio held no speech the pipeline answered")
    for t in result.turns:
        c = t.clocks
        print(f"turn {t.turn}{' (interrupted)' if t.interrupted else ''}")
        print(f"  caller: {t.user_text}")
        print(f"  bot:    {t.bot_text if t.interrupted else t.bot_text or t.llm_text}")
        print(
            f"  request->first token {_fmt(c.request_to_first_token_ms)}, "
            f"ITL mean {_fmt(c.itl_ms.mean)} p95 {_fmt(c.itl_ms.p95)}, "
            f"turn end->first audio {_fmt(c.turn_end_to_first_audio_ms)}"
        )
        prep = t.preparation
        if prep.prepared:
            lead = f", started {_fmt(prep.lead_ms)} before the VAD stop" if prep.committed else ""
            print(f"  prepared early: {'committed' if prep.committed else 'not committed'}"
                  f"{lead}; {prep.discarded} discarded ({prep.discarded_tokens} tokens, "
                  f"{_fmt(prep.discarded_audio_ms)} of audio)")
        if t.barge_in_to_silence_ms is not None:
            print(f"  barge-in -> bot silent {_fmt(t.barge_in_to_silence_ms)} (detection "
                  f"{_fmt(t.barge_in_detection_ms)}, stopping "
                  f"{_fmt(t.interruption_to_silence_ms)})")
    print(f"turn records: {result.jsonl}")


def run_call(cfg: Config, args) -> int:
    audio = read_wav(args.wav, RATE)  # AudioFormatError (a ValueError) for a bad file
    say = logs.write  # progress goes to stderr
    shared = load_shared(cfg, say)
    try:
        result = asyncio.run(simulate_call(cfg, shared, audio, realtime=not args.fast))
    finally:
        shared.close()
    if args.out:
        write_call_wav(args.out, result)
    if args.json:
        print(json.dumps({"call_id": result.call_id, "turns": [t.to_dict() for t in result.turns]}))
    else:
        print_turns(result)
        if args.out:
            print(f"audio (left: caller, right: bot): {args.out}")
    return 0
