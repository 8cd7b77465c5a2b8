"""`agent.examples`: an example exchange rendered after the system prompt, prefilled at the call's
start with it."""

from __future__ import annotations

from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.tests.utils import run_test

from llm_engine.prompts import encode_chat
from tests.voiceagent.test_llm_service import SESSION, _context, _service, make_serving  # noqa: F401
from voiceagent.config import AgentConfig, load_config
from voiceagent.pipeline.llm_service import chat_messages

EXAMPLE = [{"role": "user", "content": "Bus stop library please."},
           {"role": "assistant", "content": "Sorry, could you say it again?"}]


def test_examples_become_alternating_chat_messages():
    agent = AgentConfig(examples=[{"user": "Bus stop library please.",
                                   "assistant": "Sorry, could you say it again?"}])
    assert agent.example_messages() == EXAMPLE


def test_the_default_config_ships_no_examples():
    """They cut echoes (docs/BENCHMARKS.md) but the reply to a tool's result stopped saying it
    (test_call's order status): off until an exchange is found that keeps both."""
    assert load_config(None).agent.example_messages() == []


def test_examples_follow_the_system_prompt_and_precede_the_conversation():
    context = LLMContext(messages=[{"role": "user", "content": "Hi"}])
    assert chat_messages(context, "Be brief.", EXAMPLE) == [
        {"role": "system", "content": "Be brief."}, *EXAMPLE, {"role": "user", "content": "Hi"}]
    own = LLMContext(messages=[{"role": "system", "content": "Mine."},
                               {"role": "user", "content": "Hi"}])
    assert chat_messages(own, "Be brief.", EXAMPLE) == [
        {"role": "system", "content": "Mine."}, *EXAMPLE, {"role": "user", "content": "Hi"}]


async def test_start_prefills_the_examples_with_the_system_prompt(make_serving, tokenizer):  # noqa: F811
    serving = make_serving()
    llm = _service(serving, tokenizer, system_prompt="Be brief.", examples=EXAMPLE)
    await run_test(llm, frames_to_send=[_context("Hello")])
    warmup, request = serving.handles
    start = [{"role": "system", "content": "Be brief."}, *EXAMPLE]
    assert warmup.state.prompt_ids == encode_chat(tokenizer, start)
    assert request.state.prompt_ids == encode_chat(
        tokenizer, [*start, {"role": "user", "content": "Hello"}])
    # The reply prefilled only the caller's words: the examples came from the session's KV.
    reused = request.state.stats.reused_prefix_tokens
    assert EXAMPLE[-1]["content"] in tokenizer.decode(request.state.prompt_ids[:reused])
