"""The echo rate: how often the bot repeats the caller's words instead of answering.

    .venv/bin/python -m voiceagent.bench.echo [--config C] [--set KEY=VALUE ...]
        [--prompts configs/prompts/echo_v1.yaml] [--variants a,b] [--limit N] [--out FILE.json]

Each caller utterance of the set is sent as the first turn of a call, the way the pipeline sends
it: the agent's system prompt, its example exchange and its tools rendered by
`llm_service.chat_messages` and `EngineChat` (tools grammar, a call required when the words
trigger a tool; a tool call runs and the reply to its result is what the caller hears), greedy,
on a session whose system prompt was prefilled first, as a call's is at its start. The variants
of the set override the agent's and the sampling settings on one loaded engine, so their
latencies are measured in the same run. Prints the JSON report, then a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import re
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import yaml
from pipecat.processors.aggregators.llm_context import LLMContext

from voiceagent import logs
from voiceagent.config import PROMPTS_DIR, Config, load_config
from voiceagent.llm_setup import build_runtime
from voiceagent.pipeline.chat_backend import EngineChat, ToolUse
from voiceagent.pipeline.llm_service import chat_messages
from voiceagent.pipeline.tool_calls import ToolPolicy
from voiceagent.tools import Tool, load_tools

ECHO_PROMPTS = PROMPTS_DIR / "echo_v1.yaml"
ECHO_SHARE = 0.75  # of the caller's word 3-grams in the reply's first sentence: an echo
_CONTRACTIONS = {"n't": " not", "'m": " am", "'re": " are", "'ll": " will", "'ve": " have",
                 "'d": " would", "'s": " is"}
_CONTRACTION = re.compile(r"(n't|'m|'re|'ll|'ve|'d|'s)\b")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def words(text: str) -> list[str]:
    """Lower-case words with contractions expanded ("I'm" -> "i am") and punctuation dropped."""
    text = text.lower().replace("\u2019", "'").replace("won't", "will not").replace("can't",
                                                                                  "cannot")
    text = _CONTRACTION.sub(lambda m: _CONTRACTIONS[m.group(1)], text)
    return re.findall(r"[a-z0-9]+", text)


def first_sentence(text: str) -> str:
    return _SENTENCE_END.split(text.strip(), maxsplit=1)[0]


def _trigrams(tokens: list[str]) -> set[tuple[str, ...]]:
    return {tuple(tokens[i : i + 3]) for i in range(len(tokens) - 2)}


def echoes(caller: str, reply: str) -> bool:
    """The overlap rule: a reply echoes the caller when, after `words` normalisation,
    - the whole reply equals the caller's words ("Hello." -> "Hello!"), or
    - the caller said at least 3 words and at least ECHO_SHARE (0.75) of the caller's distinct
      word 3-grams appear in the reply's first sentence ("I am a helmet western." -> "I'm a
      helmet western. How can I help?").
    A reply that picks up part of the question to answer it ("The capital of France is Paris."
    for "What is the capital of France?": 2 of 4) or acknowledges it in its own words is not one.
    """
    said, answer = words(caller), words(reply)
    if said and answer == said:
        return True
    grams = _trigrams(said)
    if not grams:
        return False
    found = grams & _trigrams(words(first_sentence(reply)))
    return len(found) >= ECHO_SHARE * len(grams)


@dataclass
class Turn:
    segment: str
    caller: str
    reply: str
    echo: bool
    reply_words: int
    tool_calls: list[str]  # the tools the reply called before answering
    ttft_ms: float | None  # the first request's time to its first token
    decode_ms: float  # time between first and last token, every request of the turn
    decode_tokens: int  # tokens after each request's first


@dataclass
class VariantResult:
    name: str
    note: str
    turns: list[Turn]
    prefill_tokens: int  # system prompt + examples, prefilled once at the call's start
    prefill_ms: float

    def summary(self) -> dict:
        n = len(self.turns)
        ttfts = [t.ttft_ms for t in self.turns if t.ttft_ms is not None]
        decode_tokens = sum(t.decode_tokens for t in self.turns)
        return {
            "variant": self.name,
            "note": self.note,
            "echo_rate": sum(t.echo for t in self.turns) / n,
            "echoes": sum(t.echo for t in self.turns),
            "turns": n,
            "mean_reply_words": sum(t.reply_words for t in self.turns) / n,
            "mean_ttft_ms": sum(ttfts) / len(ttfts) if ttfts else None,
            "decode_ms_per_token": (sum(t.decode_ms for t in self.turns) / decode_tokens
                                    if decode_tokens else None),
            "call_start_prefill_tokens": self.prefill_tokens,
            "call_start_prefill_ms": self.prefill_ms,
        }


def load_echo_set(path: Path) -> tuple[list[tuple[str, str]], dict[str, dict]]:
    """(segment, utterance) pairs and the variants (name -> overrides) of an echo set."""
    data = yaml.safe_load(path.read_text()) or {}
    utterances = [(str(segment), str(u)) for segment, items in data["utterances"].items()
                  for u in items]
    return utterances, dict(data.get("variants") or {"configured": {}})


def variant_config(cfg: Config, overrides: dict) -> Config:
    """`cfg` with a variant's agent and sampling sections merged in; the engine's model,
    speculation and format stay the loaded one's."""
    extra = set(overrides) - {"note", "agent", "engine"}
    engine = overrides.get("engine") or {}
    if extra or set(engine) - {"sampling"}:
        raise ValueError(f"a variant may only set agent.* and engine.sampling.*: {overrides}")
    data = cfg.model_dump()
    data["agent"].update(overrides.get("agent") or {})
    data["engine"]["sampling"].update(engine.get("sampling") or {})
    out = Config.model_validate(data)
    out.engine.sampling.temperature = 0.0  # greedy: the figures reproduce
    return out


async def _turn(chat: EngineChat, cfg: Config, tools: list[Tool], session: str,
                segment: str, caller: str) -> Turn:
    context = LLMContext(messages=[{"role": "user", "content": caller}])
    system, examples = cfg.agent.system_prompt, cfg.agent.example_messages()
    policy = ToolPolicy(tuple(tools), cfg.agent.max_tool_calls)
    use = policy.first(caller) if tools else None
    called, ttft, decode_ms, decode_tokens = [], None, 0.0, 0
    for _ in range(cfg.agent.max_tool_calls + 1):
        messages = chat_messages(context, system, examples)
        done = await chat.submit(messages, cfg.engine.sampling, session, None, use).result()
        times = done.stats.token_times_ms
        ttft = done.stats.ttft_ms if ttft is None else ttft
        if len(times) > 1:
            decode_ms += times[-1] - times[0]
            decode_tokens += len(times) - 1
        if not done.tool_calls:
            break
        # As pipecat's function-calling flow writes it: the call, then its result.
        for n, call in enumerate(done.tool_calls):
            tool = next(t for t in tools if t.name == call["name"])
            result = await tool.run(call.get("arguments") or {}, cfg.agent.tool_timeout_s)
            called.append(tool.name)
            call_id = f"call_{n}"
            context.add_message({"role": "assistant", "content": done.text or None,
                                 "tool_calls": [{"id": call_id, "type": "function", "function": {
                                     "name": tool.name,
                                     "arguments": json.dumps(call.get("arguments") or {})}}]})
            context.add_message({"role": "tool", "tool_call_id": call_id,
                                 "content": json.dumps(result.content)})
        use = policy.after(len(called))
    reply = done.text.strip()
    return Turn(segment, caller, reply, echoes(caller, reply), len(words(reply)), called, ttft,
                decode_ms, decode_tokens)


async def run_variants(chat: EngineChat, configs: dict[str, Config], notes: dict[str, str],
                       tools: list[Tool], utterances: list[tuple[str, str]]
                       ) -> list[VariantResult]:
    """Every variant on its own session (a call), its system prompt prefilled first; then each
    utterance through every variant in turn, so a machine whose load drifts during the run
    weighs on all variants alike."""
    use = ToolUse([t.schema for t in tools]) if tools else None
    results = {}
    for name, cfg in configs.items():
        start = chat_messages(LLMContext(), cfg.agent.system_prompt, cfg.agent.example_messages())
        one = replace(cfg.engine.sampling, max_new_tokens=1)  # the call's start: prefill only
        warm = await chat.submit(start, one, f"echo-{name}", None, use).result()
        results[name] = VariantResult(name, notes[name], [], warm.stats.prefill_tokens,
                                      warm.stats.prefill_ms or 0.0)
    for i, (segment, caller) in enumerate(utterances, 1):
        for name, cfg in configs.items():
            turn = await _turn(chat, cfg, tools, f"echo-{name}", segment, caller)
            results[name].turns.append(turn)
        logs.write(f"{i}/{len(utterances)}: {caller}")
    for name in configs:
        chat.drop_session(f"echo-{name}")
    return list(results.values())


def markdown(summaries: list[dict]) -> str:
    def ms(value: float | None) -> str:
        return "–" if value is None else f"{value:.1f}"

    rows = ["| variant | echo rate | echoes | mean reply words | TTFT ms | decode ms/token "
            "| call-start prefill (tokens, ms) |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in summaries:
        rows.append(f"| {s['variant']} | {s['echo_rate']:.0%} | {s['echoes']}/{s['turns']} | "
                    f"{s['mean_reply_words']:.1f} | {ms(s['mean_ttft_ms'])} | "
                    f"{ms(s['decode_ms_per_token'])} | {s['call_start_prefill_tokens']}, "
                    f"{s['call_start_prefill_ms']:.0f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m voiceagent.bench.echo",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="config file (default: the CPU default)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a config key (repeatable)")
    parser.add_argument("--prompts", type=Path, default=ECHO_PROMPTS,
                        help="echo set (default: configs/prompts/echo_v1.yaml)")
    parser.add_argument("--variants", default=None, help="comma-separated subset of the set's")
    parser.add_argument("--limit", type=int, default=None, help="only the first N utterances")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    args = parser.parse_args(argv)
    logs.configure()
    cfg = load_config(args.config, args.overrides)
    utterances, variants = load_echo_set(args.prompts)
    utterances = utterances[: args.limit]
    if args.variants:
        names = args.variants.split(",")
        if unknown := [n for n in names if n not in variants]:
            parser.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(variants)}")
        variants = {n: variants[n] for n in names}
    configs = {name: variant_config(cfg, copy.deepcopy(v or {})) for name, v in variants.items()}
    tools = load_tools(cfg.agent.tools)
    from llm_engine.serving import EngineWorker

    serving, runtime = EngineWorker.build(
        lambda: build_runtime(cfg.engine, cfg.paths.cache_dir, logs.write))
    chat = EngineChat(serving, runtime.target.tokenizer)
    if tools:
        chat.prepare_tools(ToolPolicy(tuple(tools), cfg.agent.max_tool_calls).every_use())

    notes = {name: str((v or {}).get("note", "")) for name, v in variants.items()}

    async def run_all() -> list[VariantResult]:
        try:
            return await run_variants(chat, configs, notes, tools, utterances)
        finally:
            serving.close()

    results = asyncio.run(run_all())
    summaries = [r.summary() for r in results]
    report = {"prompts": str(args.prompts), "echo_share": ECHO_SHARE,
              "engine": {"target": cfg.engine.target, "method": cfg.engine.speculation.method},
              "summary": summaries,
              "turns": {r.name: [asdict(t) for t in r.turns] for r in results}}
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    print()
    print(markdown(summaries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
