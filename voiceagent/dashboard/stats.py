"""The figures of a set of turns: one definition shared by `bench call`, the dashboard's APIs and
`voiceagent report`, so the three agree by construction.

A turn comes in as a TurnRecord's dict (the store's JSON) and is read back through the typed
TurnRecord. ITL percentiles and its mean pool every inter-token gap of the turns; accepted tokens
per step pools every speculative step of the turns (a turn of ten steps weighs ten times a turn of
one; the per-turn values' distribution is given apart); the other clocks are one value per turn.
"""

from __future__ import annotations

import re

import numpy as np

from llm_engine.stats import RequestStats
from voiceagent.figures import percentile
from voiceagent.pipeline.turn_record import TurnRecord

BREAKDOWN = ("vad_hangover_ms", "asr_final_ms", "tool_call_ms", "tools_ms", "prefill_ms",
             "first_token_ms", "first_clause_ms", "tts_first_chunk_ms")


def _pcts(xs: list[float], qs=(50, 95, 99)) -> dict:
    return {f"p{q}": percentile(xs, q) for q in qs}


def summarise(turns: list[dict]) -> dict:
    """Pool turn records into the figures of one group (a mode, a method, a window)."""
    records = [TurnRecord.from_dict(t) for t in turns]

    def values(get) -> list[float]:
        return [v for r in records if (v := get(r)) is not None]

    clock3 = values(lambda r: r.clocks.turn_end_to_first_audio_ms)
    clock1 = values(lambda r: r.clocks.request_to_first_token_ms)
    itl = [x for r in records if r.engine for x in r.engine.itl_ms]
    barge = values(lambda r: r.barge_in_to_silence_ms)
    spec = [turn_speculation(r.engine) for r in records]
    spec_steps = sum(s["speculative_steps"] for s in spec)
    by_turn = [s["accepted_per_step"] for s in spec if s["accepted_per_step"] is not None]
    interrupted = sum(r.interrupted for r in records)
    itl_turns = sum(bool(r.engine and r.engine.itl_ms) for r in records)

    def spread(get) -> dict:
        xs = values(get)
        return {"p50": percentile(xs, 50), "max": max(xs, default=None)}

    return {
        "turns": len(records),
        "calls": len({r.call_id for r in records}),
        "interrupted": interrupted,
        "interrupted_share": interrupted / len(records) if records else None,
        # Turns that went on with the one before as its reply began: one sentence of the caller's
        # (and one answer) across two turns.
        "continued": sum(r.continues for r in records),
        # Pauses a turn ended at and the caller went on from before hearing the reply: each is
        # inside the turn's record, its reply withdrawn unheard.
        "early_ends": sum(r.early_ends for r in records),
        "turn_end_to_first_audio_ms": _pcts(clock3),
        "request_to_first_token_ms": _pcts(clock1, (50, 95)),
        "itl_ms": {**_pcts(itl), "mean": float(np.mean(itl)) if itl else None},
        # The caller's first voiced frame over the bot -> its silence; detection (-> the
        # interruption) and stopping (-> silence) are its two parts.
        "barge_in_to_silence_ms": spread(lambda r: r.barge_in_to_silence_ms),
        "barge_in_detection_ms": spread(lambda r: r.barge_in_detection_ms),
        "interruption_to_silence_ms": spread(lambda r: r.interruption_to_silence_ms),
        "accepted_per_step": (sum(s["accepted"] for s in spec) / spec_steps
                              if spec_steps else None),
        "accepted_per_step_by_turn": _pcts(by_turn, (50, 95)),
        "breakdown_p50_ms": {k: percentile(values(lambda r, k=k: getattr(r.breakdown, k)), 50)
                             for k in BREAKDOWN},
        "preparation": preparation(records),
        # How many turns each figure is over (a clock not measured in a turn leaves it out);
        # ITL pools gaps, so its turns and its gaps both.
        "samples": {
            "turn_end_to_first_audio_ms": len(clock3),
            "request_to_first_token_ms": len(clock1),
            "itl_turns": itl_turns,
            "itl_gaps": len(itl),
            "speculative_steps": spec_steps,
            "accepted_per_step_turns": len(by_turn),
            "barge_in_to_silence_ms": len(barge),
        },
    }


def _same_words(a: str, b: str) -> bool:
    words = [re.sub(r"[^\w\s]", " ", x.casefold()).split() for x in (a, b)]
    return words[0] == words[1]


def preparation(records: list[TurnRecord]) -> dict:
    """Early preparation: how often a prepared reply answered the turn, how often one was
    dropped, and the work dropped as a share of the work that answered (tokens, audio)."""
    preps = [r.preparation for r in records]
    committed = [r for r in records if r.preparation.committed]

    def share(wasted: float, used: float) -> float | None:
        return wasted / used if used else None

    return {
        "prepared_turns": sum(p.prepared > 0 for p in preps),
        "committed": len(committed),
        # A committed reply prepared from another transcript than the final one (must be 0).
        "false_commits": sum(not _same_words(r.preparation.prepared_text, r.user_text)
                             for r in committed if r.preparation.prepared_text is not None),
        "discarded": sum(p.discarded for p in preps),
        "lead_ms_p50": percentile([p.lead_ms for p in preps if p.lead_ms is not None], 50),
        "wasted_tokens_share": share(sum(p.discarded_tokens for p in preps),
                                     sum(p.answer_tokens for p in preps)),
        "wasted_audio_share": share(sum(p.discarded_audio_ms for p in preps),
                                    sum(p.answer_audio_ms for p in preps)),
    }


METHOD_ORDER = ("off", "ngram", "draft", "eagle")


def method_of(turn: dict) -> str:
    """A stored turn's method, read from its JSON without building the whole record (the
    filters ask it of every turn); `TurnRecord.method` says the same of a record."""
    return (turn.get("engine") or {}).get("method") or "unknown"


def ordered(methods) -> list[str]:
    """Methods in a fixed order: off, ngram, draft, then any others by name."""
    rank = {m: i for i, m in enumerate(METHOD_ORDER)}
    return sorted(set(methods), key=lambda m: (rank.get(m, len(rank)), m))


def by_method(turns: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for t in turns:
        groups.setdefault(method_of(t), []).append(t)
    return {m: groups[m] for m in ordered(groups)}


def matching(turns: list[dict], method: str | None = None,
             call_ids: set[str] | None = None) -> list[dict]:
    """The turns of one speculation method and/or of some calls (None: any)."""
    return [t for t in turns if (method is None or method_of(t) == method)
            and (call_ids is None or t.get("call_id") in call_ids)]


def facets(turns: list[dict], config_hashes: dict[str, str | None]) -> dict:
    """What the turns can be filtered by, with how many turns each choice keeps: their methods,
    and the config hashes of their calls (`config_hashes`: call id -> hash; calls without one
    are left out)."""
    methods: dict[str, int] = {}
    hashes: dict[str, dict] = {}
    for t in turns:
        m = method_of(t)
        methods[m] = methods.get(m, 0) + 1
        h = config_hashes.get(t.get("call_id"))
        if h:
            entry = hashes.setdefault(h, {"config_hash": h, "turns": 0, "calls": set()})
            entry["turns"] += 1
            entry["calls"].add(t.get("call_id"))
    return {
        "methods": [{"method": m, "turns": methods[m]} for m in ordered(methods)],
        "config_hashes": [{**e, "calls": len(e["calls"])} for e in
                          sorted(hashes.values(), key=lambda e: (-e["turns"], e["config_hash"]))],
    }


def itl_speedup(off: dict | None, method: dict) -> dict:
    """How much sooner a method's tokens come than with speculation off: off's mean inter-token
    gap over the method's, each pooled over every gap of its turns (`summarise`). The mean, not
    the p50: the tokens one speculative step accepts arrive together, so most of a fast method's
    gaps are 0 and its p50 says nothing. With the turns and gaps each side is over."""
    off = off or {}
    off_mean, mean = (s.get("itl_ms", {}).get("mean") for s in (off, method))
    return {
        "value": off_mean / mean if off_mean is not None and mean else None,
        "turns": method["samples"]["itl_turns"],
        "gaps": method["samples"]["itl_gaps"],
        "off_turns": off.get("samples", {}).get("itl_turns", 0),
        "off_gaps": off.get("samples", {}).get("itl_gaps", 0),
    }


def overview(turns: list[dict]) -> dict:
    """All turns together, and split by speculation method (the A/B view), each method with its
    ITL speed-up over the turns with speculation off."""
    methods = {m: summarise(ts) for m, ts in by_method(turns).items()}
    for summary in methods.values():
        summary["itl_speedup"] = itl_speedup(methods.get("off"), summary)
    return {**summarise(turns), "by_method": methods}


def speculation(turns: list[dict]) -> dict:
    """Pooled speculation detail: accepted tokens per step, rejection positions, drafting
    against verification time per step, and each turn's K history."""
    accept_hist: list[int] = []
    rejection_hist: list[int] = []
    steps = []
    records = [TurnRecord.from_dict(t) for t in turns]
    for engine in (r.engine for r in records if r.engine is not None):
        for n, count in enumerate(engine.accept_len_hist):
            accept_hist += [0] * (n + 1 - len(accept_hist))
            accept_hist[n] += count
        for s in engine.steps:
            if s.drafted:
                steps.append({"draft_ms": s.draft_ms, "verify_ms": s.verify_ms,
                              "accepted": s.accepted, "method": engine.method})
            if s.rejection_pos is not None:
                pos = s.rejection_pos
                rejection_hist += [0] * (pos + 1 - len(rejection_hist))
                rejection_hist[pos] += 1
    return {
        "accepted_per_step_hist": accept_hist,
        "rejection_position_hist": rejection_hist,
        "steps": steps,
        "k_history": [{"call_id": r.call_id, "turn": r.turn, "method": r.method,
                       "k": r.engine.k_history if r.engine else []} for r in records],
    }


def turn_speculation(engine: RequestStats | None) -> dict:
    """One turn's speculation, from its engine stats (None: no request answered): the method; its
    decode steps and, of those, the speculative ones (that drafted); tokens drafted and accepted;
    accepted tokens per speculative step; the acceptance rate (accepted / drafted); and the K
    asked for over the steps that asked for a draft (K 0 is a plain step: the gate was closed, or
    speculation off)."""
    if engine is None:
        engine = RequestStats(method="unknown")
    asked = [k for k in engine.k_history or [s.k for s in engine.steps] if k > 0]
    return {
        "method": engine.method,
        "steps": len(engine.steps),
        "speculative_steps": sum(1 for s in engine.steps if s.drafted),
        "drafted": engine.drafted,
        "accepted": engine.accepted,
        "accepted_per_step": engine.mean_accepted_per_step,
        "acceptance_rate": engine.acceptance_rate,
        "k_min": min(asked, default=None),
        "k_max": max(asked, default=None),
        "k_mean": sum(asked) / len(asked) if asked else None,
    }


def recording_marks(turns: list[dict], started_at: float) -> list[dict]:
    """Where each turn's stages fall on its call's recording (seconds from its first sample,
    `started_at` being the wall clock there): the caller's speech end, the end of the VAD's
    hangover, the bot's first audio (clock 3 after the speech end), and a barge-in where the
    next turn cut the reply short. The dashboard's waveform and `voiceagent report` draw these."""
    records = [TurnRecord.from_dict(t) for t in turns]
    marks = []
    for r, after in zip(records, [*records[1:], None], strict=True):
        start = r.started_at - started_at
        end = r.breakdown.user_speech_ms
        stages = {"speech end": end,
                  "hangover": _plus(end, r.breakdown.vad_hangover_ms),
                  "first audio": _plus(end, r.clocks.turn_end_to_first_audio_ms)}
        marks += [{"turn": r.turn, "mark": name, "s": start + ms / 1000}
                  for name, ms in stages.items() if ms is not None]
        if r.interrupted and after is not None:
            marks.append({"turn": r.turn, "mark": "barge-in", "s": after.started_at - started_at})
    return marks


def _plus(a: float | None, b: float | None) -> float | None:
    return a + b if a is not None and b is not None else None
