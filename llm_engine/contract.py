"""The draft/target compatibility contract, checked before a pair serves, and its pair card.

A draft proposes token ids that the target verifies, so both must mean the same thing by every
id: the token->id maps, the special tokens and the chat template must agree. Losslessness does
not depend on this (the target decides every token); acceptance, and therefore speed, does.

Embedding matrices are often padded past the tokenizer (Qwen2.5-7B has 152064 rows, 0.5B has
151936, for 151665 tokens), so model vocab sizes are not compared with each other. We compare
the tokenizers, and separately require each lm_head to cover every tokenizer id. Padding ids
are never text; the engine can slice both models' logits to `shared_vocab_size`.

Chat templates are compared as text first. When the text differs, both are rendered on a few
probe conversations with the clock pinned (Llama 3.2's template prints today's date where 3.1's
prints a fixed one), and equal renderings count as the same template.

`make_pair_card` runs these checks and records the accepted pair; the card's fields live in
`pair_card.py`.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from dataclasses import asdict
from datetime import UTC, datetime

from llm_engine.config import EngineConfig
from llm_engine.errors import IncompatiblePairError
from llm_engine.methods import model_settings
from llm_engine.pair_card import (
    ModelIdentity,
    PairCard,
    fallback_text,
    proposer_record,
    runtime_record,
)

MAX_SHOWN = 5  # differences shown per section of the error
PINNED_DATE = "26 Jul 2024"  # passed to templates as `date_string`
PROBES = (
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ],
)
NAMED_SPECIALS = ("bos_token", "eos_token", "pad_token", "unk_token")


def check_pair(target_tok, draft_tok, *, names: tuple[str, str] = ("target", "draft")) -> None:
    """Raise IncompatiblePairError unless the two tokenizers are interchangeable."""
    problems = (
        _vocab_problems(target_tok, draft_tok, names)
        + _special_problems(target_tok, draft_tok, names)
        + template_status(target_tok, draft_tok)[1]
    )
    if problems:
        head = f"draft {names[1]!r} is not compatible with target {names[0]!r}"
        raise IncompatiblePairError(head + ":\n" + "\n".join(problems))


def check_lm_heads(tokenizer, target_model, draft_model) -> None:
    """Each lm_head must produce every tokenizer id; extra (padding) rows are fine."""
    n = len(tokenizer)
    problems = [
        f"  {role} lm_head has {rows} rows but the tokenizer has {n} tokens: "
        f"ids {rows}..{n - 1} could never be {verb}"
        for role, model, verb in (
            ("target", target_model, "verified"),
            ("draft", draft_model, "drafted"),
        )
        if (rows := output_rows(model)) < n
    ]
    if problems:
        raise IncompatiblePairError("vocabulary size mismatch:\n" + "\n".join(problems))


def output_rows(model) -> int:
    """Width of the logits the model produces (a compact draft's head scores a subset of the
    vocabulary but scatters it into full-width logits: `full_vocab`)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if getattr(head, "full_vocab", None):
        return int(head.full_vocab)
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if weight is not None else int(model.config.vocab_size)


def _vocab_problems(t, d, names) -> list[str]:
    tv, dv = t.get_vocab(), d.get_vocab()
    if tv == dv:
        return []
    differing = [tok for tok in tv.keys() | dv.keys() if tv.get(tok) != dv.get(tok)]
    first = heapq.nsmallest(
        MAX_SHOWN, differing, key=lambda tok: min(tv.get(tok, 1 << 62), dv.get(tok, 1 << 62))
    )
    lines = [
        f"vocabulary: {names[0]} has {len(tv)} tokens, {names[1]} has {len(dv)}; "
        f"{len(differing)} token->id entries differ, first by id:"
    ]
    for tok in first:
        lines.append(
            f"  {tok!r}: {names[0]} id {tv.get(tok, 'missing')}, "
            f"{names[1]} id {dv.get(tok, 'missing')}"
        )
    return lines


def special_tokens(tok) -> dict:
    """The named special tokens with ids, and every other special token with its id."""
    out: dict = {k: [getattr(tok, k, None), getattr(tok, k + "_id", None)] for k in NAMED_SPECIALS}
    extra = (
        getattr(tok, "additional_special_tokens", None)
        or getattr(tok, "extra_special_tokens", None)
        or []
    )
    extra = list(extra.values()) if isinstance(extra, dict) else list(extra)
    every = sorted(set(tok.all_special_tokens) | {str(s) for s in extra})
    out["all"] = [[s, tok.convert_tokens_to_ids(s)] for s in every]
    return out


def _special_problems(t, d, names) -> list[str]:
    ts, ds = special_tokens(t), special_tokens(d)
    lines = [
        f"  {k}: {names[0]} {ts[k][0]!r} (id {ts[k][1]}), {names[1]} {ds[k][0]!r} (id {ds[k][1]})"
        for k in NAMED_SPECIALS
        if ts[k] != ds[k]
    ]
    only_t = [s for s in ts["all"] if s not in ds["all"]][:MAX_SHOWN]
    only_d = [s for s in ds["all"] if s not in ts["all"]][:MAX_SHOWN]
    if only_t or only_d:
        lines.append(f"  special tokens only in {names[0]}: {only_t}; only in {names[1]}: {only_d}")
    return ["special tokens:"] + lines if lines else []


def _templates(tok) -> dict[str, str]:
    tpl = getattr(tok, "chat_template", None)
    if tpl is None:
        return {}
    return dict(tpl) if isinstance(tpl, dict) else {"default": tpl}


def _render(tok, template: str) -> list[str]:
    out = []
    for messages in PROBES:
        for gen in (False, True):
            try:
                out.append(
                    tok.apply_chat_template(
                        messages,
                        chat_template=template,
                        tokenize=False,
                        add_generation_prompt=gen,
                        date_string=PINNED_DATE,
                    )
                )
            except Exception as exc:  # a template may reject a probe (e.g. no system role)
                out.append(f"<error {type(exc).__name__}>")
    return out


def first_difference(a: str, b: str) -> str:
    """'line L, column C' of the first differing character, with an excerpt of each side."""
    pairs = enumerate(zip(a, b, strict=False))  # unequal lengths: the shorter one ends first
    i = next((k for k, (x, y) in pairs if x != y), min(len(a), len(b)))
    line, col = a.count("\n", 0, i) + 1, i - (a.rfind("\n", 0, i) + 1) + 1
    lo, hi = max(0, i - 15), i + 35  # a little context before, more after the difference
    return f"line {line}, column {col}: {a[lo:hi]!r} vs {b[lo:hi]!r}"


def template_status(t, d) -> tuple[str, list[str]]:
    """('identical' | 'equivalent on probe conversations' | 'none' | 'different', problems)."""
    tt, dt = _templates(t), _templates(d)
    if tt == dt:
        return ("identical" if tt else "none"), []
    if tt.keys() != dt.keys():
        return "different", [f"chat template: names differ: {sorted(tt)} vs {sorted(dt)}"]
    problems = []
    for name in sorted(tt):
        if tt[name] == dt[name]:
            continue
        rt, rd = _render(t, tt[name]), _render(d, dt[name])
        if rt == rd and any(not r.startswith("<error") for r in rt):
            continue
        where = first_difference(tt[name], dt[name])
        diffs = (first_difference(a, b) for a, b in zip(rt, rd, strict=True) if a != b)
        shown = next(diffs, "")
        problems.append(
            f"chat template {name!r}: first difference at {where}"
            + (f"\n  rendered probe differs at {shown}" if shown else "")
        )
    return ("different", problems) if problems else ("equivalent on probe conversations", [])


def _sha256(obj) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def tokenizer_summary(tok) -> dict:
    vocab = tok.get_vocab()
    return {
        "class": type(tok).__name__,
        "vocab_size": len(vocab),
        "vocab_sha256": _sha256(sorted(vocab.items(), key=lambda kv: kv[1])),
        "special_tokens": special_tokens(tok),
        "chat_template_sha256": _sha256(_templates(tok)) if _templates(tok) else None,
    }


def compatibility(target, draft) -> dict:
    """Check a LoadedModel pair (raises IncompatiblePairError) and summarise it for the card."""
    result = {
        "tokenizer": tokenizer_summary(target.tokenizer),
        "target_lm_head_rows": output_rows(target.model),
    }
    if draft is None:
        return {"status": "not applicable: no draft model", **result}
    check_pair(target.tokenizer, draft.tokenizer, names=(target.name, draft.name))
    check_lm_heads(target.tokenizer, target.model, draft.model)
    return {
        "status": "compatible",
        **result,
        "draft_lm_head_rows": output_rows(draft.model),
        "shared_vocab_size": len(target.tokenizer),
        "chat_template": template_status(target.tokenizer, draft.tokenizer)[0],
    }


def make_pair_card(target, draft, config: EngineConfig, resident_bytes: int) -> PairCard:
    """Check a pair (raises IncompatiblePairError) and record it as a pair card.

    `target` and `draft` are `loading.LoadedModel`s; `draft` is None for methods without one.
    `resident_bytes` is the measured memory of the whole pair.
    """
    if config.speculation.method in model_settings() and draft is None:
        raise ValueError(f"speculation method {config.speculation.method!r} needs its draft")
    card = PairCard(
        target=ModelIdentity.from_loaded(target),
        draft=ModelIdentity.from_loaded(draft) if draft is not None else None,
        proposer=proposer_record(config.speculation, draft),
        sampling=asdict(config.sampling),
        max_context=config.max_context,
        resident_bytes=int(resident_bytes),
        runtime=runtime_record(target.device, config.speculation.method, config.runner),
        fallback=fallback_text(config.speculation),
        compatibility=compatibility(target, draft),
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    card.card_hash = card.compute_hash()
    return card
