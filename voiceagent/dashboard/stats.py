"""The figures of a set of turns: one definition shared by `bench call`, the dashboard's APIs and
`voiceagent report`, so the three agree by construction.

A turn is a TurnRecord as a dict (TurnRecord.to_dict()). ITL percentiles pool every inter-token
gap of the turns; the other clocks are one value per turn.
"""

from __future__ import annotations

import numpy as np

from voiceagent.bench_report import percentile

BREAKDOWN = ("vad_hangover_ms", "asr_final_ms", "prefill_ms", "first_token_ms",
             "first_clause_ms", "tts_first_chunk_ms")


def _pcts(xs: list[float], qs=(50, 95, 99)) -> dict:
    return {f"p{q}": percentile(xs, q) for q in qs}


def summarise(turns: list[dict]) -> dict:
    """Pool turn records into the figures of one group (a mode, a method, a window)."""
    def values(get) -> list[float]:
        return [v for t in turns if (v := get(t)) is not None]

    clock3 = values(lambda t: t["clocks"]["turn_end_to_first_audio_ms"])
    clock1 = values(lambda t: t["clocks"]["request_to_first_token_ms"])
    itl = [x for t in turns for x in (t["engine"].get("itl_ms") or [])]
    barge = values(lambda t: t["barge_in_to_silence_ms"])
    accepted = values(lambda t: t["engine"].get("mean_accepted_per_step"))
    return {
        "turns": len(turns),
        "calls": len({t["call_id"] for t in turns}),
        "interrupted": sum(bool(t["interrupted"]) for t in turns),
        "interrupted_share": (sum(bool(t["interrupted"]) for t in turns) / len(turns)
                              if turns else None),
        "turn_end_to_first_audio_ms": _pcts(clock3),
        "request_to_first_token_ms": _pcts(clock1, (50, 95)),
        "itl_ms": _pcts(itl),
        "barge_in_to_silence_ms": {"p50": percentile(barge, 50), "max": max(barge, default=None)},
        "mean_accepted_per_step": float(np.mean(accepted)) if accepted else None,
        "breakdown_p50_ms": {k: percentile(values(lambda t, k=k: t["breakdown"].get(k)), 50)
                             for k in BREAKDOWN},
        "preparation": preparation(turns),
    }


def preparation(turns: list[dict]) -> dict:
    """Early preparation: how often a prepared reply answered the turn, how often one was
    dropped, and the work dropped as a share of the work that answered (tokens, audio)."""
    preps = [t.get("preparation") or {} for t in turns]  # records older than it have none

    def total(key: str) -> float:
        return sum(p.get(key) or 0 for p in preps)

    def share(wasted: str, used: str) -> float | None:
        return total(wasted) / total(used) if total(used) else None

    return {
        "prepared_turns": sum(bool(p.get("prepared")) for p in preps),
        "committed": sum(bool(p.get("committed")) for p in preps),
        "discarded": int(total("discarded")),
        "lead_ms_p50": percentile([p["lead_ms"] for p in preps
                                   if p.get("lead_ms") is not None], 50),
        "wasted_tokens_share": share("discarded_tokens", "answer_tokens"),
        "wasted_audio_share": share("discarded_audio_ms", "answer_audio_ms"),
    }


METHOD_ORDER = ("off", "ngram", "draft", "eagle")


def method_of(turn: dict) -> str:
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


def overview(turns: list[dict]) -> dict:
    """All turns together, and split by speculation method (the A/B view)."""
    return {**summarise(turns),
            "by_method": {m: summarise(ts) for m, ts in by_method(turns).items()}}


def speculation(turns: list[dict]) -> dict:
    """Pooled speculation detail: accepted tokens per step, rejection positions, drafting
    against verification time per step, and each turn's K history."""
    accept_hist: list[int] = []
    rejection_hist: list[int] = []
    steps = []
    for t in turns:
        engine = t.get("engine") or {}
        for n, count in enumerate(engine.get("accept_len_hist") or []):
            accept_hist += [0] * (n + 1 - len(accept_hist))
            accept_hist[n] += count
        for s in engine.get("steps") or []:
            if s.get("drafted"):
                steps.append({"draft_ms": s["draft_ms"], "verify_ms": s["verify_ms"],
                              "accepted": s["accepted"], "method": engine.get("method")})
            if s.get("rejection_pos") is not None:
                pos = s["rejection_pos"]
                rejection_hist += [0] * (pos + 1 - len(rejection_hist))
                rejection_hist[pos] += 1
    return {
        "accepted_per_step_hist": accept_hist,
        "rejection_position_hist": rejection_hist,
        "steps": steps,
        "k_history": [{"call_id": t["call_id"], "turn": t["turn"],
                       "k": (t.get("engine") or {}).get("k_history") or []} for t in turns],
    }
