"""`voiceagent call`: a simulated phone call from a WAV file, its turns printed and stored.

The caller's audio streams in as 20 ms frames (real time by default); the bot's audio is placed on
the same timeline, so OUT.wav (left: caller, right: bot) lets you hear overlap and barge-in.
"""

from __future__ import annotations

import asyncio
import json

from audio.wav import read_wav
from voiceagent import logs
from voiceagent.config import Config
from voiceagent.dashboard.store import open_store
from voiceagent.figures import fmt
from voiceagent.pipeline.builder import load_shared
from voiceagent.sim.call import RATE, CallResult, simulate_call, write_call_wav


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
    store = open_store(cfg)
    try:
        result = asyncio.run(simulate_call(cfg, shared, audio, realtime=not args.fast,
                                           store=store))
    finally:
        store.close()
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
