"""`/v1/chat/completions` and `/v1/models`: OpenAI's request and response shapes, its errors,
streaming, limits, and cancelling on disconnect. Fast tests run the app with a tiny engine; the
slow ones drive `voiceagent serve` in another process with the official `openai` client, and
time it as `bench engine --anchor-url` does."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from llm_engine.config import SamplingConfig
from llm_engine.loading import servable_folder
from tests.voiceagent.server_proc import running_server
from tests.voiceagent.serving import server_config, serving
from tests.voiceagent.tiny_shared import tiny_shared
from voiceagent.bench.anchor import AnchorError, anchor_runner, connect
from voiceagent.bench.engine import BenchPrompt
from voiceagent.config import load_config
from voiceagent.models import resolve

MODEL = "smollm2-135m-instruct"  # the default config's target: the id /v1 serves
HELLO = [{"role": "user", "content": "Hello there, who are you?"}]
ORDER = {"type": "function", "function": {
    "name": "lookup_order", "description": "An order's status.",
    "parameters": {"type": "object", "required": ["order_id"], "additionalProperties": False,
                   "properties": {"order_id": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}


@pytest.fixture
async def tiny_api(tmp_path):
    """A real server on a loopback port (streams stream) with a tiny random engine."""
    shared = tiny_shared()
    async with serving(server_config(tmp_path, "server.token=s3cret"), shared) as (app, base):
        async with httpx.AsyncClient(base_url=base, timeout=30,
                                     headers={"Authorization": "Bearer s3cret"}) as http:
            yield app, http
    shared.close()


async def test_models_lists_the_target_and_needs_the_token(tiny_api):
    _app, http = tiny_api
    listed = (await http.get("/v1/models")).json()
    refused = await http.get("/v1/models", headers={"Authorization": "Bearer nope"})
    assert [m["id"] for m in listed["data"]] == [MODEL]
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"


async def test_a_body_that_is_not_json_or_a_wrong_method_gets_openais_error_shape(tiny_api):
    _app, http = tiny_api
    garbled = await http.post("/v1/chat/completions", content=b"{not json")
    wrong = await http.delete("/v1/chat/completions")
    assert garbled.status_code == 400
    assert garbled.json()["error"] == {"message": "body is not JSON", "code": None,
                                       "type": "invalid_request_error", "param": None}
    assert wrong.status_code == 405 and wrong.json()["error"]["message"] == "Method Not Allowed"
    assert wrong.headers["allow"] == "POST"


async def test_a_completion_has_openai_shape_usage_and_the_engine_stats(tiny_api):
    _app, http = tiny_api
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 5, "temperature": 0}
    got = (await http.post("/v1/chat/completions", json=body)).json()
    choice = got["choices"][0]
    assert got["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("length", "stop")
    assert got["usage"]["completion_tokens"] == got["voiceagent"]["generated_tokens"] <= 5
    assert got["usage"]["total_tokens"] == got["usage"]["prompt_tokens"] + got["usage"][
        "completion_tokens"]
    assert got["voiceagent"]["method"]  # the extension: speculation stats per request


async def test_a_stream_sends_role_then_text_then_finish_usage_and_done(tiny_api):
    _app, http = tiny_api
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and "voiceagent" in finish[0]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 6


@pytest.mark.parametrize("change,status,param", [
    ({"model": "gpt-4o"}, 404, "model"),
    ({"tools": [{"type": "function"}]}, 400, "tools.0.function"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"tools": [ORDER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, 400,
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bad"}}}]},
     400, "tools"),
    ({"response_format": {"type": "json_schema"}}, 400, "response_format"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "bad"}}}}, 400,
     "response_format"),
    ({"response_format": {"type": "json_object"}, "tools": [ORDER], "tool_choice": "required"},
     400, "response_format"),
    ({"logprobs": True}, 400, "logprobs"),
    ({"n": 2}, 400, "n"),
    ({"temperature": 3}, 400, "temperature"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
])
async def test_what_is_not_supported_is_a_clear_error(tiny_api, change, status, param):
    _app, http = tiny_api
    response = await http.post("/v1/chat/completions",
                               json={"model": MODEL, "messages": HELLO, **change})
    error = response.json()["error"]
    assert response.status_code == status and error["param"] == param and error["message"]


async def test_a_required_tool_call_comes_back_schema_valid_with_finish_tool_calls(tiny_api):
    _app, http = tiny_api
    for seed in range(3):
        body = {"model": MODEL, "messages": HELLO, "max_tokens": 200, "temperature": 1.0,
                "seed": seed, "tools": [ORDER], "tool_choice": "required"}
        choice = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]
        [call] = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls"
        assert call["function"]["name"] == "lookup_order"
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            ORDER["function"]["parameters"])


async def test_a_named_tool_choice_streams_the_call_as_tool_call_deltas(tiny_api):
    _app, http = tiny_api
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 200, "stream": True,
            "tools": [ORDER], "tool_choice": {"type": "function",
                                              "function": {"name": "lookup_order"}}}
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        chunks = [json.loads(line[6:]) async for line in response.aiter_lines()
                  if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert not any(d.get("content") for d in deltas), "the call is not text"
    [calls] = [d["tool_calls"] for d in deltas if d.get("tool_calls")]
    assert calls[0]["index"] == 0 and calls[0]["function"]["name"] == "lookup_order"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_a_json_schema_response_format_gives_json_that_holds(tiny_api):
    _app, http = tiny_api
    schema = {"type": "object", "required": ["day"], "additionalProperties": False,
              "properties": {"day": {"enum": ["monday", "friday"]}}}
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 200, "temperature": 1.0, "seed": 3,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "slot", "schema": schema}}}
    got = (await http.post("/v1/chat/completions", json=body)).json()
    jsonschema.validate(json.loads(got["choices"][0]["message"]["content"]), schema)


async def test_a_conversation_with_a_tool_result_is_answered(tiny_api):
    _app, http = tiny_api
    call = {"id": "c1", "type": "function",
            "function": {"name": "lookup_order", "arguments": '{"order_id": "48213"}'}}
    messages = [*HELLO, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": '{"status": "shipped"}'}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "tools": [ORDER]}
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


async def test_requests_over_the_limit_are_429(tiny_api):
    app, http = tiny_api
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 1500, "stream": True}
    async with http.stream("POST", "/v1/chat/completions", json=body), \
            http.stream("POST", "/v1/chat/completions", json=body):
        third = await http.post("/v1/chat/completions", json=body)
    assert third.status_code == 429 and third.json()["error"]["type"] == "rate_limit_error"


# -- against `voiceagent serve` in another process -------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("v1")
    with running_server("--set", f"paths.runs_dir={tmp}", "--set", "server.max_api_requests=4",
                        log_path=tmp / "serve.log") as url:
        yield url


@pytest.mark.slow
def test_the_openai_client_streams_with_usage_stops_and_reproduces_a_seed(served):
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage.completion_tokens > 0
    first_word = text.split()[0]
    stopped = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=24,
                                             temperature=0, stop=[first_word])
    assert first_word not in stopped.choices[0].message.content
    assert stopped.choices[0].finish_reason == "stop"
    seeded = [client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=16,
                                             temperature=0.8, seed=7).choices[0].message.content
              for _ in range(2)]
    assert seeded[0] == seeded[1]


@pytest.mark.slow
async def test_a_client_that_goes_away_cancels_its_request(served):
    async with httpx.AsyncClient(base_url=served, timeout=30) as http:
        body = {"model": MODEL, "messages": HELLO, "max_tokens": 400, "stream": True}
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if '"content"' in line:
                    break  # one token seen: hang up

        async def in_flight() -> float:
            metrics = (await http.get("/metrics")).text
            return next(float(line.split()[-1]) for line in metrics.splitlines()
                        if line.startswith("voiceagent_engine_requests_in_flight"))

        values = []
        for _ in range(100):
            values.append(await in_flight())
            if values[-1] == 0:
                break
            await asyncio.sleep(0.1)
    assert values[-1] == 0, values  # 400 tokens would take ~10 s: it was cancelled


@pytest.mark.slow
def test_the_bench_anchor_times_an_openai_compatible_server(served):
    cfg = load_config()
    folder = servable_folder(resolve(cfg.engine.target, "llm").location, cfg.paths.cache_dir,
                             lambda _: None)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with pytest.raises(AnchorError, match="does not serve 'nope'"):
        connect(f"{served}/v1", "nope")
    client, model = connect(f"{served}/v1", None)
    run = anchor_runner(client, model, tokenizer)
    got = run(BenchPrompt([], HELLO), SamplingConfig(max_new_tokens=16))
    times = got["token_times_ms"]
    assert model == MODEL and 0 < len(got["token_ids"]) <= 17
    assert len(times) == len(got["token_ids"]) and times == sorted(times) and times[0] > 0
    assert got["finish_reason"] in ("eos", "length")


@pytest.mark.slow
async def test_pipecats_openai_service_talks_to_v1(served):
    """pipecat's own OpenAI LLM service, pointed at our endpoint, streams a reply as text frames
    between the response start and end frames, as it does against OpenAI or vLLM."""
    from pipecat.frames.frames import (
        LLMContextFrame,
        LLMFullResponseEndFrame,
        LLMFullResponseStartFrame,
        LLMTextFrame,
    )
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.services.openai.llm import OpenAILLMService
    from pipecat.tests.utils import run_test

    llm = OpenAILLMService(api_key="unused", base_url=f"{served}/v1",
                           settings=OpenAILLMService.Settings(model=MODEL, max_tokens=16))
    context = LLMContext(messages=[{"role": "user", "content": "Say hello."}])
    down, _up = await asyncio.wait_for(
        run_test(llm, frames_to_send=[LLMContextFrame(context=context)]), 60)
    kinds = [type(f) for f in down]
    text = "".join(f.text for f in down if isinstance(f, LLMTextFrame))
    assert text.strip()
    assert kinds.index(LLMFullResponseStartFrame) < kinds.index(LLMTextFrame) < kinds.index(
        LLMFullResponseEndFrame)
