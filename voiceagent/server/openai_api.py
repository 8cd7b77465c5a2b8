"""`/v1/chat/completions` and `/v1/models`: the engine behind the OpenAI API, on `serve`.

So OpenAI-compatible clients (the `openai` package, pipecat's and LiveKit's OpenAI services,
benchmark tools) can use our engine as they use vLLM. Behind the server's token (a Bearer
header). Supported: `messages` (system, user, assistant, tool; text content; an assistant's
`tool_calls`), `tools` with `tool_choice` (none, auto, required, or one named function) and
`response_format` (text, json_object, json_schema), both decoded under a grammar
(`llm_engine.grammar`, so a call's arguments follow the tool's schema: at most one call per
reply), `stream` with
`stream_options.include_usage` and `continuous_usage_stats` (vLLM's: the running usage on every
chunk, so a client can count a speculative step's tokens), `max_tokens` /
`max_completion_tokens`, `temperature`, `top_p`, `top_k` (vLLM's extension), `seed`, `stop` (up
to 4), `n` = 1, and `user`,
which keys the engine's prefix cache: a client's next turn reuses the KV of its last one.
Anything else a request sets (logprobs, n > 1, ...) is refused with a 400
that names it, never silently ignored. A client that goes away
cancels its request at the engine's next step. The engine's per-request speculation stats travel
in an extension field, `voiceagent`, of the response (streamed: of the last chunk).

Errors use OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 bad request,
401 no token, 404 unknown model, 429 over `server.max_api_requests` requests at once (calls
have their own limit), 503 while the models load.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from llm_engine.config import GrammarSpec, SamplingConfig
from llm_engine.grammar import check_spec
from voiceagent.pipeline.chat_backend import ToolUse
from voiceagent.server.auth import authorized
from voiceagent.server.guard import json_object
from voiceagent.server.state import ServerState

router = APIRouter()
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}
HANDLED = {"model", "messages", "stream", "stream_options", "max_tokens",
           "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "user",
           "tools", "tool_choice", "parallel_tool_calls", "response_format"}


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Function(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class FunctionTool(BaseModel):
    type: Literal["function"]
    function: Function


class CalledFunction(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class NamedChoice(BaseModel):
    type: Literal["function"]
    function: dict[Literal["name"], str]


class JsonSchemaFormat(BaseModel):
    name: str
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool result's

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content)

    def as_chat(self) -> dict:
        """The message as `llm_engine.prompts` renders it."""
        message: dict = {"role": "system" if self.role == "developer" else self.role,
                         "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id or ""
        return message


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    stream_options: dict | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # vLLM's and SGLang's extension; 0 disables
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)
    user: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool | None = None  # one call a reply at most, whatever it says
    response_format: ResponseFormat | None = None


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status, message, kind, param, code)

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind,
                                       "param": self.param, "code": self.code}}, self.status)


def _kind(status: int) -> str:
    """OpenAI's error type for an HTTP status."""
    return {401: "authentication_error", 404: "not_found_error",
            429: "rate_limit_error"}.get(status, "server_error" if status >= 500
                                         else "invalid_request_error")


async def http_error(request: Request, exc: StarletteHTTPException):
    """Errors raised before or around a /v1 handler (a body that is not JSON, a method the route
    does not take) in OpenAI's error shape, which its clients parse; elsewhere FastAPI's."""
    if not request.url.path.startswith("/v1/"):
        return await http_exception_handler(request, exc)
    response = APIError(exc.status_code, str(exc.detail), _kind(exc.status_code)).response()
    response.headers.update(exc.headers or {})
    return response


def _server(request: Request) -> ServerState:
    server: ServerState = request.app.state.server
    if not authorized(request, server.cfg.server.token):
        raise APIError(401, "missing or wrong token", "authentication_error")
    return server


def model_id(server: ServerState) -> str | None:
    """The in-process engine's target; None when the pipeline's LLM is remote (no engine)."""
    return server.cfg.engine.target if server.cfg.llm.backend == "engine" else None


@router.get("/v1/models")
async def models(request: Request):
    try:
        server = _server(request)
    except APIError as exc:
        return exc.response()
    served = [model_id(server)] if model_id(server) else []
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                        "owned_by": "voiceagent"} for name in served]}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    try:
        server = _server(request)
        body = await json_object(request, server.cfg.server.max_message_bytes)
        chat = _parse(body)
        if model_id(server) is None:
            raise APIError(404, "this server runs no in-process engine (llm.backend is openai): "
                           "ask the LLM server itself", code="model_not_found")
        if chat.model != model_id(server):
            raise APIError(404, f"model '{chat.model}' is not served here; GET /v1/models",
                           param="model", code="model_not_found")
        if server.shared is None:
            raise APIError(503, "models still loading, try again shortly", "server_error")
        server.api_handles = {h for h in server.api_handles if not h.done}
        if len(server.api_handles) >= server.cfg.server.max_api_requests:
            raise APIError(429, f"too many requests at once (at most "
                           f"{server.cfg.server.max_api_requests})", "rate_limit_error")
        sampling = _sampling(server, chat)
        # Namespaced, so an API client's id never names a call's session.
        session = f"api:{chat.user}" if chat.user else None
        handle = server.shared.chat.submit([m.as_chat() for m in chat.messages], sampling,
                                           session, server.cfg.engine.speculation.method,
                                           _tool_use(chat))
    except APIError as exc:
        return exc.response()
    except ValueError as exc:  # the engine refused the prompt (too long for its context)
        return APIError(400, str(exc), param="messages").response()
    except RuntimeError as exc:  # the engine is closed or its worker died
        return APIError(503, str(exc), "server_error").response()
    server.api_handles.add(handle)  # counted until done, however the client leaves
    reply = Reply(chat, handle, len(handle.state.prompt_ids))
    if chat.stream:
        return StreamingResponse(reply.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await reply.whole()


def _parse(body: dict) -> ChatRequest:
    unknown = sorted(set(body) - HANDLED)
    if unknown:
        raise APIError(400, f"not supported here: {', '.join(unknown)}", param=unknown[0],
                       code="unsupported_parameter")
    try:
        chat = ChatRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise APIError(400, f"{where}: {err['msg']}", param=where) from None
    stops = [chat.stop] if isinstance(chat.stop, str) else chat.stop or []
    if len(stops) > 4:
        raise APIError(400, "stop: at most 4 sequences", param="stop")
    _check_tools(chat)
    return chat


def _check_tools(chat: ChatRequest) -> None:
    names = [t.function.name for t in chat.tools or []]
    if isinstance(chat.tool_choice, NamedChoice):
        if chat.tool_choice.function.get("name") not in names:
            raise APIError(400, "tool_choice names a function that is not in tools",
                           param="tool_choice")
    elif chat.tool_choice in ("auto", "required") and not names:
        raise APIError(400, f"tool_choice '{chat.tool_choice}' needs tools", param="tool_choice")
    response = chat.response_format
    if response is not None and response.type != "text" and _tool_use(chat) is not None:
        raise APIError(400, "response_format and tools cannot both constrain one reply",
                       param="response_format")
    if response is not None and response.type == "json_schema" and response.json_schema is None:
        raise APIError(400, "response_format json_schema needs json_schema",
                       param="response_format")
    use = _tool_use(chat)
    for spec, param in ((_grammar(chat), "response_format"), (use and use.grammar(), "tools")):
        try:
            if spec is not None:
                check_spec(spec)
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from None


def _tool_use(chat: ChatRequest) -> ToolUse | None:
    if not chat.tools or chat.tool_choice == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in chat.tools]
    if isinstance(chat.tool_choice, NamedChoice):
        return ToolUse(tools, (chat.tool_choice.function["name"],))
    required = tuple(t.function.name for t in chat.tools) if chat.tool_choice == "required" else ()
    return ToolUse(tools, required)


def _grammar(chat: ChatRequest) -> GrammarSpec | None:
    response = chat.response_format
    if response is None or response.type == "text":
        return None
    if response.type == "json_object":
        return GrammarSpec(kind="json_schema", json_schema={"type": "object"})
    return GrammarSpec(kind="json_schema", json_schema=response.json_schema.schema_)


def _sampling(server: ServerState, chat: ChatRequest) -> SamplingConfig:
    default = server.cfg.engine.sampling
    limit = chat.max_completion_tokens or chat.max_tokens or default.max_new_tokens
    return SamplingConfig(
        temperature=default.temperature if chat.temperature is None else chat.temperature,
        top_k=default.top_k if chat.top_k is None else chat.top_k,
        top_p=default.top_p if chat.top_p is None else chat.top_p,
        seed=chat.seed,
        max_new_tokens=limit,
        stop=[chat.stop] if isinstance(chat.stop, str) else list(chat.stop or []),
        grammar=_grammar(chat),
    )


def _finish(completion) -> str:
    return "tool_calls" if completion.tool_calls else FINISH[completion.finish_reason]


class Reply:
    def __init__(self, chat: ChatRequest, handle, prompt_tokens: int):
        self.chat, self.handle, self.prompt_tokens = chat, handle, prompt_tokens
        self.id = "chatcmpl-" + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _base(self) -> dict:
        return {"id": self.id, "created": self.created, "model": self.chat.model}

    def _usage(self, n: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
                "total_tokens": self.prompt_tokens + n}

    async def whole(self):
        completion = await self.handle.result()
        if completion.finish_reason == "error":
            return APIError(500, completion.error or "generation failed", "server_error").response()
        message = {"role": "assistant", "content": completion.text}
        if completion.tool_calls:
            message = {"role": "assistant", "content": completion.text or None,
                       "tool_calls": self._calls(completion)}
        return {**self._base(), "object": "chat.completion",
                "choices": [{"index": 0, "finish_reason": _finish(completion),
                             "message": message}],
                "usage": self._usage(len(completion.token_ids)),
                "voiceagent": completion.stats.to_dict()}

    def _calls(self, completion) -> list[dict]:
        return [{"id": f"call_{self.id[-24:]}_{i}", "type": "function",
                 "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}
                for i, call in enumerate(completion.tool_calls)]

    def _chunk(self, delta: dict, finish: str | None = None, **extra) -> str:
        data = {**self._base(), "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
        return f"data: {json.dumps(data)}\n\n"

    async def stream(self):
        """SSE chunks; a client gone mid-stream closes this generator, which cancels the
        request (the engine frees its KV at the next step)."""
        options = self.chat.stream_options or {}
        running = bool(options.get("continuous_usage_stats"))
        tokens = 0
        try:
            yield self._chunk({"role": "assistant", "content": ""},
                              **({"usage": self._usage(0)} if running else {}))
            async for delta in self.handle:
                tokens += len(delta.token_ids)
                if delta.text:
                    yield self._chunk({"content": delta.text},
                                      **({"usage": self._usage(tokens)} if running else {}))
            completion = await self.handle.result()
            if completion.finish_reason == "error":
                error = {"message": completion.error or "generation failed",
                         "type": "server_error", "param": None, "code": None}
                yield f"data: {json.dumps({'error': error})}\n\n"
            else:
                if completion.tool_calls:
                    calls = [{"index": i, **call} for i, call in
                             enumerate(self._calls(completion))]
                    yield self._chunk({"tool_calls": calls})
                yield self._chunk({}, _finish(completion),
                                  voiceagent=completion.stats.to_dict())
                if options.get("include_usage"):
                    usage = {**self._base(), "object": "chat.completion.chunk", "choices": [],
                             "usage": self._usage(len(completion.token_ids))}
                    yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.handle.cancel()
