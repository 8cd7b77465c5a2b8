"""`voiceagent bench asr`: Whisper on the speech window against the padded 30 s window.

The project's own caller phrases (the call script's turns and the echo set's utterances), spoken
by the configured Piper voice at several rates, with the lead and trailing silence the VAD leaves
around an utterance. Each clip is transcribed in both windows, one after the other, so machine
noise falls on both. Reported per window: word error against the text that was spoken, run time
p50/p95, and for the speech window how often a doubtful cut run fell back to the padded one.
"""

from __future__ import annotations

import re
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import yaml

from audio.asr import StreamingTranscriber
from audio.loaders import load_piper
from audio.synth import silence, synthesize
from voiceagent.bench.call import DEFAULT_SCRIPT
from voiceagent.bench.echo import ECHO_PROMPTS
from voiceagent.bench.results import save_results, utc_stamp
from voiceagent.config import Config
from voiceagent.figures import fmt, percentile
from voiceagent.logs import progress_bar
from voiceagent.models import resolve
from voiceagent.pipeline.stt import load_asr_model

# Each variant's settings over the configured ASR: Whisper's 30 s window, the speech window,
# and the speech window that redoes a run holding digits on the padded one.
VARIANTS = {
    "padded": {"window": "padded"},
    "speech": {"window": "speech", "digits_padded": False},
    "speech, digits padded": {"window": "speech", "digits_padded": True},
}
RATES = (0.8, 1.0, 1.3)  # Piper length_scale: fast, the voice's own, slow
LEAD_S, TRAIL_S = 0.3, 0.5  # silence around the speech: the preroll and the VAD's hangover
_NUMBERS = {w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve".split())}


def phrases() -> list[str]:
    """The caller phrases the project's benches speak, each once."""
    script = yaml.safe_load(Path(DEFAULT_SCRIPT).read_text())
    said = [t["say"] for call in script["calls"] for t in call["turns"]]
    echo = yaml.safe_load(Path(ECHO_PROMPTS).read_text())["utterances"]
    said += [u for group in ("questions", "statements", "greetings") for u in echo[group]]
    return list(dict.fromkeys(said))


def normalise(text: str) -> list[str]:
    """Lower-case words, punctuation dropped, numbers as single digits ("4815", "four eight one
    five" and "4 8 1 5" are the same words)."""
    words = re.findall(r"[a-z0-9']+", text.lower().replace("-", " "))
    out: list[str] = []
    for word in words:
        word = _NUMBERS.get(word, word)
        out += list(word) if word.isdigit() else [word]
    return out


def word_errors(reference: list[str], hypothesis: list[str]) -> int:
    """Substitutions, insertions and deletions (Levenshtein distance over words)."""
    row = list(range(len(hypothesis) + 1))
    for i, ref in enumerate(reference, 1):
        prev, row[0] = row[0], i
        for j, hyp in enumerate(hypothesis, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ref != hyp))
    return row[-1]


def run_asr_bench(cfg: Config, args) -> int:
    voice = load_piper(resolve(cfg.tts.voice, "tts").location)
    whisper = load_asr_model(cfg.asr)
    texts = phrases()
    rates = [float(r) for r in args.rates.split(",")] if args.rates else list(RATES)
    runs: list[dict] = []
    bar = progress_bar(len(texts) * len(rates), "bench asr", "clip")
    try:
        for i, text in enumerate(texts):
            for rate in rates:
                clip = np.concatenate([silence(LEAD_S), synthesize(voice, text, 16000, rate),
                                       silence(TRAIL_S)])
                names = list(VARIANTS)
                for variant in (names if i % 2 == 0 else names[::-1]):
                    tr = StreamingTranscriber(whisper, replace(cfg.asr, **VARIANTS[variant]))
                    tr.feed(clip)
                    t0 = time.perf_counter()
                    heard = tr.final()
                    ms = (time.perf_counter() - t0) * 1000
                    ref = normalise(text)
                    runs.append({"text": text, "rate": rate, "variant": variant, "ms": ms,
                                 "audio_s": len(clip) / 16000, "heard": heard.text,
                                 "answered_by": heard.window, "fallback": heard.fallback,
                                 "words": len(ref),
                                 "errors": word_errors(ref, normalise(heard.text)),
                                 "digits_wrong": _digits(ref) != _digits(normalise(heard.text))
                                 if _digits(ref) else None})
                bar.update()
    finally:
        bar.close()
    summary = {v: summarise([r for r in runs if r["variant"] == v]) for v in VARIANTS}
    stamp = utc_stamp()
    markdown = (f"# ASR benchmark\n\n- {stamp}, `{cfg.asr.model}`, {len(texts)} phrases x "
                f"{len(rates)} rates (Piper `{cfg.tts.voice}`, length_scale "
                f"{', '.join(map(str, rates))}), {LEAD_S} s lead and {TRAIL_S} s trailing "
                f"silence; speech window margin {cfg.asr.window_margin_ms} ms, at least "
                f"{cfg.asr.window_min_ms} ms\n\n" + render(summary) + "\n")
    save_results(args.out, "asr", stamp, markdown,
                 {"summary": summary, "runs": runs, "config": cfg.asr.__dict__})
    return 0


def _digits(words: list[str]) -> list[str]:
    return [w for w in words if w.isdigit()]


def summarise(runs: list[dict]) -> dict:
    """Word error rate pooled over all words (errors / reference words), the clips with digits
    whose digits were misheard, run time p50/p95, and the share of runs the padded window
    answered."""
    words = sum(r["words"] for r in runs)
    ms = [r["ms"] for r in runs]
    with_digits = [r for r in runs if r["digits_wrong"] is not None]
    return {
        "clips": len(runs),
        "wer": sum(r["errors"] for r in runs) / words if words else None,
        "digit_clips": len(with_digits),
        "digits_wrong": sum(r["digits_wrong"] for r in with_digits),
        "ms_p50": percentile(ms, 50), "ms_p95": percentile(ms, 95),
        "padded_share": sum(r["answered_by"] == "padded" for r in runs) / len(runs)
        if runs else None,
    }


def render(summary: dict[str, dict]) -> str:
    rows = ["| variant | clips | word error | digits misheard | run p50 ms | run p95 ms | "
            "answered by the padded run |",
            "| --- | --: | --: | --: | --: | --: | --: |"]
    for variant, s in summary.items():
        wer = "-" if s["wer"] is None else f"{100 * s['wer']:.1f}%"
        share = "-" if s["padded_share"] is None else f"{100 * s['padded_share']:.0f}%"
        rows.append(f"| {variant} | {s['clips']} | {wer} | "
                    f"{s['digits_wrong']} of {s['digit_clips']} | {fmt(s['ms_p50'], 0)} | "
                    f"{fmt(s['ms_p95'], 0)} | {share} |")
    return "\n".join(rows)
