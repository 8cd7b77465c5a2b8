"""A simulated phone call from a WAV file through the real pipeline (`voiceagent call`, benches).

The caller's audio streams in as 20 ms frames (real time by default); the bot's audio is placed on
the same timeline, so OUT.wav (left: caller, right: bot) lets you hear overlap and barge-in.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pipecat.frames.frames import EndFrame
from pipecat.workers.runner import WorkerRunner

from audio.wav import write_wav
from voiceagent.config import Config, config_hash
from voiceagent.pipeline.builder import SharedModels, build_call
from voiceagent.pipeline.records import CallInfo, CallLog, JsonlTurnSink, TurnRecords
from voiceagent.pipeline.telemetry import telemetry_sink
from voiceagent.pipeline.turn_record import TurnRecord
from voiceagent.pipeline.wav_transport import WavCallTransport

RATE = 16000  # the simulated line's rate, in and out
QUIET_S = 1.5  # after the caller's audio, hang up once the bot has been idle this long
MAX_WAIT_S = 60.0  # ... or at the latest this long after the caller's audio ended


@dataclass
class CallResult:
    call_id: str
    turns: list[TurnRecord]
    caller: np.ndarray  # int16 at RATE, as sent (with the silences the caller waited)
    bot: np.ndarray  # int16 at RATE, on the caller's timeline
    jsonl: Path
    messages: list[dict]  # the conversation context at hang-up


async def simulate_call(
    cfg: Config,
    shared: SharedModels,
    audio: np.ndarray,
    realtime: bool = True,
    method: str | None = None,
    store: CallLog | None = None,
    after_bot: dict[int, float] | None = None,
) -> CallResult:
    """Run one call with `audio` (int16 mono at RATE) as the caller; return its turns. At each
    sample index of `after_bot`, the caller waits until they have heard that many seconds of
    the bot in all before going on (`CallResult.caller` has those silences).

    Turns go to a JSONL file under the runs folder and, with `store` (the caller's, left open),
    to the turn store with the call's start and end.
    """
    transport = WavCallTransport(audio, RATE, RATE, realtime=realtime, after_bot=after_bot)
    sink = JsonlTurnSink(cfg.paths.runs_dir)
    ours = [sink, *filter(None, [telemetry_sink(cfg)])]  # closed here; the store is the caller's
    records = TurnRecords(list(ours))
    call = build_call(cfg, shared, transport, records.add, method=method)
    if store is not None:
        records.sinks.append(store)
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
        if store is not None:
            store.end_call(call.call_id, time.time())
        for mine in ours:
            mine.close()
    caller = transport.input().as_sent()
    bot = transport.output().timeline(max(len(caller) / RATE, transport.clock.now()))
    return CallResult(
        call.call_id, records.by_call.get(call.call_id, []), caller, bot,
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
