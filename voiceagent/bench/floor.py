"""The per-stage floor for `voiceagent bench call`: what each stage of turn end -> first audio
costs alone on this machine, measured after the calls with the same loaded models, so a stage's
p50 in the calls can be read against it and the remaining gap is visible at a glance.

Alone means one stage at a time, nothing else running:
- hangover: the configured `vad.stop_secs` (a held turn adds `turn.unfinished_hold_s`, a
  caller who went on after a pause `turn.resumed_hold_s`);
- ASR final: one Whisper run (the configured window) on each caller utterance of the script;
- prefill: the caller's words on top of the call's cached system prompt, as a turn prefills them;
- first clause: the reply's first token -> its first phrase complete (the TTS's split), with the
  configured speculation method;
- TTS first chunk: Piper synthesising that first phrase, to its first audio.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import numpy as np

from audio.asr import StreamingTranscriber
from audio.synth import synthesize
from audio.text import ClauseSplitter
from llm_engine.config import SamplingConfig
from voiceagent.config import Config
from voiceagent.figures import fmt, percentile
from voiceagent.pipeline.builder import SharedModels
from voiceagent.sim.call import RATE

# (breakdown key, what it is)
STAGES = (("vad_hangover_ms", "hangover"), ("asr_final_ms", "ASR final"),
          ("prefill_ms", "prefill"), ("first_clause_ms", "first clause"),
          ("tts_first_chunk_ms", "TTS first chunk"))


async def measure_floor(cfg: Config, shared: SharedModels, utterances: list[str]) -> dict:
    """Each stage's cost alone (ms, the median over the script's utterances)."""
    speech = shared.speech
    asr, prefill, clause, chunk = [], [], [], []
    for i, text in enumerate(utterances):
        audio = synthesize(speech.voice, text, RATE)
        tr = StreamingTranscriber(speech.whisper, cfg.asr)
        tr.feed(audio)
        asr.append(tr.final().model_ms)
        if shared.worker is None:
            continue  # a remote LLM: its stages are the server's
        session = f"floor-{i}"
        system = [{"role": "system", "content": cfg.agent.system_prompt}]
        one = SamplingConfig(max_new_tokens=1)
        await shared.chat.submit(system, one, session, None).result()
        handle = shared.chat.submit([*system, {"role": "user", "content": text}],
                                    replace(cfg.engine.sampling, max_new_tokens=48), session,
                                    None)
        phrase, first_ms, phrase_ms = await _first_phrase(cfg, handle)
        completion = await handle.result()
        shared.chat.drop_session(session)
        if completion.stats.prefill_ms is not None:
            prefill.append(completion.stats.prefill_ms)
        if phrase:
            clause.append(phrase_ms - first_ms)
            ms = await asyncio.to_thread(_first_chunk_ms, speech.voice, phrase)
            if ms is not None:
                chunk.append(ms)
    return {
        "vad_hangover_ms": cfg.vad.stop_secs * 1000,
        "asr_final_ms": percentile(asr, 50),
        "prefill_ms": percentile(prefill, 50),
        "first_clause_ms": percentile(clause, 50),
        "tts_first_chunk_ms": percentile(chunk, 50),
    }


async def _first_phrase(cfg: Config, handle) -> tuple[str, float, float]:
    """The reply's first phrase as the TTS cuts it, the time of its first token and the time it
    was complete (ms, perf_counter)."""
    splitter = ClauseSplitter(cfg.tts.min_clause_chars, cfg.tts.first_phrase_words)
    first = None
    async for delta in handle:
        if not delta.text:
            continue
        first = first if first is not None else delta.t
        clauses = splitter.push(delta.text)
        if clauses:
            handle.cancel()
            return clauses[0], first * 1000, delta.t * 1000
    rest = splitter.flush()
    return (rest or "", first * 1000, time.perf_counter() * 1000) if first else ("", 0.0, 0.0)


def _first_chunk_ms(voice, phrase: str) -> float | None:
    start = time.perf_counter()
    chunk = next(iter(voice.synthesize(phrase)), None)
    elapsed = (time.perf_counter() - start) * 1000
    return elapsed if chunk is not None and np.size(chunk.audio_int16_array) else None


def render_floor(floor: dict, summary: dict[str, dict]) -> str:
    """Each stage's p50 in the calls, per variant, beside its cost alone."""
    modes = list(summary)
    lines = ["Per-stage floor: each stage's p50 in the calls beside what it costs alone on this "
             "machine (ms; `alone`: measured after the calls, one stage at a time):", "",
             "| stage | alone | " + " | ".join(modes) + " |",
             "|---|--:|" + "--:|" * len(modes)]
    for key, name in STAGES:
        row = " | ".join(fmt(summary[m]["breakdown_p50_ms"][key], 0) for m in modes)
        lines.append(f"| {name} | {fmt(floor.get(key), 0)} | {row} |")
    return "\n".join(lines)
