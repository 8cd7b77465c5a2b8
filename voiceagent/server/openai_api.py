"""`/v1/chat/completions` and `/v1/models`: the engine behind the OpenAI API, on `serve`.

So OpenAI-compatible clients (the `openai` package, pipecat's and LiveKit's OpenAI services,
benchmark tools) can use our engine as they use vLLM. Behind the server's token (a Bearer
header). Supported: `messages` (system, user, assistant; text content), `stream` with
`stream_options.include_usage` and `continuous_usage_stats` (vLLM's: the running usage on every
chunk, so a client can count a speculative step's tokens), `max_tokens` /
`max_completion_tokens`, `temperature`, `top_p`, `top_k` (vLLM's extension), `seed`, `stop` (up
to 4), `n` = 1, and `user`,
which keys the engine's prefix cache: a client's next turn reuses the KV of its last one.
Anything else a request sets (tools, response_format, logprobs, n > 1, ...) is refused with a 400
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
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llm_engine.config import SamplingConfig
from llm_engine.prompts import encode_chat
from voiceagent.server.auth import authorized
from voiceagent.server.guard import json_object
from voiceagent.server.state import ServerState

router = APIRouter()
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}
HANDLED = {"model", "messages", "stream", "stream_options", "max_tokens",
           "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "user"}


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content)


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


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status, message, kind, param, code)

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind,
                                       "param": self.param, "code": self.code}}, self.status)


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
        prompt = encode_chat(server.shared.llm.target.tokenizer,
                             [{"role": "system" if m.role == "developer" else m.role,
                               "content": m.text()} for m in chat.messages])
        sampling = _sampling(server, chat)
        # Namespaced, so an API client's id never names a call's session.
        session = f"api:{chat.user}" if chat.user else None
        handle = server.shared.engine.submit(prompt, sampling, session,
                                             method=server.cfg.engine.speculation.method)
    except APIError as exc:
        return exc.response()
    except ValueError as exc:  # the engine refused the prompt (too long for its context)
        return APIError(400, str(exc), param="messages").response()
    except RuntimeError as exc:  # the engine is closed or its worker died
        return APIError(503, str(exc), "server_error").response()
    server.api_handles.add(handle)  # counted until done, however the client leaves
    reply = Reply(chat, handle, len(prompt))
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
    return chat


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
    )


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
        return {**self._base(), "object": "chat.completion",
                "choices": [{"index": 0, "finish_reason": FINISH[completion.finish_reason],
                             "message": {"role": "assistant", "content": completion.text}}],
                "usage": self._usage(len(completion.token_ids)),
                "voiceagent": completion.stats.to_dict()}

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
                yield self._chunk({}, FINISH[completion.finish_reason],
                                  voiceagent=completion.stats.to_dict())
                if options.get("include_usage"):
                    usage = {**self._base(), "object": "chat.completion.chunk", "choices": [],
                             "usage": self._usage(len(completion.token_ids))}
                    yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.handle.cancel()
