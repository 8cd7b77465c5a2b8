"""`bench engine --anchor-url`: an OpenAI-compatible server (vLLM, SGLang, llama.cpp, our own `/v1`)
timed on the same prompts, as one more column beside the engine's modes.

It is sent the prompt's messages through the chat completions stream, as a voice agent would, and
timed from the request to each streamed chunk. Token counts come from re-tokenising the streamed
text with the target's tokenizer (a server may put several tokens in one chunk), so its token ids
are informative only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import openai

from llm_engine.config import SamplingConfig
from llm_engine.sampling import is_greedy


class AnchorError(RuntimeError):
    """The anchor server cannot be reached or does not serve the model."""


def connect(url: str, model: str | None, timeout_s: float = 30.0) -> tuple[openai.OpenAI, str]:
    """A client for the server and the model to ask for: `model`, else the one it serves first."""
    # A local server usually has no key; the client insists on one, so send a placeholder.
    client = openai.OpenAI(base_url=url, api_key=os.environ.get("OPENAI_API_KEY") or "none",
                           timeout=timeout_s, max_retries=0)
    try:
        served = [m.id for m in client.models.list()]
    except openai.APIError as exc:
        raise AnchorError(f"anchor {url}: cannot list its models ({exc})") from exc
    if model is None:
        if not served:
            raise AnchorError(f"anchor {url} serves no model")
        return client, served[0]
    if model not in served:
        raise AnchorError(f"anchor {url} does not serve '{model}'; it serves: {', '.join(served)}")
    return client, model


def anchor_runner(client: openai.OpenAI, model: str, tokenizer) -> Callable:
    """Runner over (prompt, sampling): one streamed chat completion, timed per chunk."""

    def run(prompt, sampling: SamplingConfig) -> dict:
        extra = {"temperature": 0.0} if is_greedy(sampling) else {
            "temperature": sampling.temperature, "top_p": sampling.top_p,
        }
        if not is_greedy(sampling) and sampling.top_k:
            extra["extra_body"] = {"top_k": sampling.top_k}  # vLLM and SGLang take it
        t0 = time.perf_counter()
        stream = client.chat.completions.create(
            model=model, messages=prompt.messages, max_tokens=sampling.max_new_tokens,
            seed=sampling.seed, stream=True, stream_options={"include_usage": True}, **extra,
        )
        text, times, counted, finish = "", [], 0, None
        for chunk in stream:
            if not chunk.choices:
                continue  # the usage chunk
            choice = chunk.choices[0]
            finish = choice.finish_reason or finish
            if not choice.delta.content:
                continue
            now_ms = (time.perf_counter() - t0) * 1000.0
            text += choice.delta.content
            total = len(tokenizer.encode(text, add_special_tokens=False))
            times += [now_ms] * max(total - counted, 0)
            counted = max(total, counted)
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        return {
            "token_ids": token_ids,
            "token_times_ms": times[: len(token_ids)],
            "finish_reason": {"stop": "eos"}.get(finish, finish),
        }

    return run
