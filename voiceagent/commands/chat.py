"""`voiceagent chat`: one reply from the engine alone, streamed to the terminal."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys

from llm_engine.prompts import encode_chat
from llm_engine.serving import EngineWorker
from voiceagent import logs
from voiceagent.config import Config
from voiceagent.llm_setup import build_runtime


def apply_chat_flags(cfg: Config, args) -> Config:
    """Fold --method/--draft/--temperature/... into the engine config."""
    spec, sampling = cfg.engine.speculation, cfg.engine.sampling
    if args.draft:
        cfg.engine.draft = args.draft
        spec.method = "draft"
    if args.method:
        spec.method = args.method
    if args.temperature is not None:
        sampling.temperature = args.temperature
    if args.max_new_tokens is not None:
        sampling.max_new_tokens = args.max_new_tokens
    if args.seed is not None:
        sampling.seed = args.seed
    return cfg


def summary(stats) -> str:
    parts = [f"{stats.generated_tokens} tokens", f"method {stats.method}"]
    if stats.ttft_ms is not None:
        parts.append(f"first token {stats.ttft_ms:.0f} ms")
    if stats.tokens_per_s:
        parts.append(f"{stats.tokens_per_s:.1f} tok/s")
    if stats.mean_accepted_per_step is not None:
        parts.append(f"{stats.mean_accepted_per_step:.2f} accepted/step")
    parts.append(f"draft {stats.draft_ms:.0f} ms, verify {stats.verify_ms:.0f} ms")
    if stats.gated_off:
        parts.append("gate turned speculation off")
    return ", ".join(parts)


async def _run(serving: EngineWorker, prompt_ids: list[int], stream: bool):
    try:
        handle = serving.submit(prompt_ids)
        async for delta in handle:
            if stream and delta.text:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
        return await handle.result()
    finally:
        serving.close()


def run_chat(cfg: Config, args) -> int:
    cfg = apply_chat_flags(cfg, args)
    say = logs.write  # progress goes to stderr
    # Loaded on the engine's own thread: torch work on two threads slows both.
    serving, runtime = EngineWorker.build(
        lambda: build_runtime(cfg.engine, cfg.paths.cache_dir, say))
    prompt_ids = encode_chat(runtime.target.tokenizer, [{"role": "user", "content": args.prompt}])
    result = asyncio.run(_run(serving, prompt_ids, stream=not args.json))
    if args.json:
        print(json.dumps({
            "text": result.text,
            "token_ids": result.token_ids,
            "finish_reason": result.finish_reason,
            "stats": result.stats.to_dict(),
            "pair_card_hash": runtime.card.card_hash,
            "config": dataclasses.asdict(cfg.engine),
        }))
    else:
        print()
        say(summary(result.stats))
    return 0 if result.finish_reason != "error" else 1
