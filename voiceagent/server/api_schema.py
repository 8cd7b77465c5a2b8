"""The request bodies and links in the app's OpenAPI document (`GET /openapi.json`).

The handlers read their JSON bodies themselves (`guard.json_object`: a size bound, then their own
checks and error shapes), so FastAPI cannot see the bodies. These models describe them, so a
client generator, or the schema fuzz in the tests (schemathesis), knows what each route takes.
The links say which route takes what another one answered (a call's id from the list of calls),
so a stateful client, or the stateful fuzz, can follow them.
"""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from voiceagent.server.openai_api import ChatRequest


class SessionRequest(BaseModel):
    token: str


class Offer(BaseModel):
    sdp: str
    type: Literal["offer"]
    pc_id: str | None = None  # a call in progress: renegotiate it
    restart_pc: bool | None = None


class Candidate(BaseModel):
    candidate: str
    sdp_mid: str
    sdp_mline_index: int


class Candidates(BaseModel):
    pc_id: str
    candidates: list[Candidate] = []


BODIES = {
    ("/api/session", "post"): SessionRequest,
    ("/api/offer", "post"): Offer,
    ("/api/offer", "patch"): Candidates,
    ("/v1/chat/completions", "post"): ChatRequest,
}


# (path, method, status) -> OpenAPI links from that answer to the routes that take its values.
LINKS = {
    ("/api/calls", "get", "200"): {"GetCall": {
        "operationRef": "#/paths/~1api~1calls~1{call_id}/get",
        "parameters": {"call_id": "$response.body#/calls/0/call_id"}}},
    ("/api/calls/{call_id}", "get", "200"): {"TurnsSince": {
        "operationRef": "#/paths/~1api~1turns/get",
        "parameters": {"since": "$response.body#/call/started_at"}}},
}


def install_openapi(app: FastAPI) -> None:
    """Generate the app's document with the request bodies and links above."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for (path, method), model in BODIES.items():
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
                doc["paths"][path][method]["requestBody"] = {"required": True, "content": {
                    "application/json": {
                        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            for (path, method, status), links in LINKS.items():
                doc["paths"][path][method]["responses"][status]["links"] = links
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
