"""Every HTTP route fuzzed from the app's own OpenAPI document with schemathesis: generated
query strings, path parameters and bodies (valid and invalid ones) against a real `voiceagent
serve` with the embedded models. No answer is a server error (a documented 503 with Retry-After,
all call slots taken by the fuzz's own offers, is a refusal), every refusal has the documented
error shape, and the server logs no unhandled exception.

Not here: `GET /api/events` (a stream that never ends by design; test_dashboard_api covers it)
and `POST /admin/drain` (it stops the server; test_server_health covers it).

Stateful too: schemathesis follows the document's links (`api_schema.LINKS`: the list of calls
to a call, a call to its turns) on a server that has taken one simulated call, and the same
checks hold at every step.

CI runs a few examples a route (`FUZZ_EXAMPLES`, default 15). A long fuzz:
`FUZZ_EXAMPLES=1000 .venv/bin/python -m pytest tests/voiceagent/test_api_fuzz.py`.
"""

from __future__ import annotations

import asyncio
import os
import re
import tempfile
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.audio.speech import speech
from tests.voiceagent.server_proc import running_server
from tests.voiceagent.serving import server_config, twilio_url
from voiceagent.server.app import create_app
from voiceagent.sim.twilio_caller import TwilioCaller

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "15"))
TOKEN = "fuzz-token"
NOT_FUZZED = r"^/(api/events|admin/drain)$"
BODIES = [("/api/session", "post"), ("/api/offer", "post"), ("/api/offer", "patch"),
          ("/v1/chat/completions", "post")]
# What a log line of an unhandled exception starts with: Python's traceback, loguru's and
# uvicorn's "Exception in ASGI application".
ANSWERS: Counter[str] = Counter()  # status classes seen, printed at the end (`-s`)
UNHANDLED = re.compile(r"^Traceback|Exception in ASGI application|\| ERROR +\| .*Traceback",
                       re.MULTILINE)


def _document() -> dict:
    """The app's OpenAPI document, from an app that serves nothing (no models, no lifespan)."""
    with tempfile.TemporaryDirectory() as tmp:
        app = create_app(server_config(tmp))
        try:
            return app.openapi()
        finally:
            app.state.server.records.close()


schema = schemathesis.openapi.from_dict(_document())


async def _one_call(base: str) -> None:
    """A call of one turn, so the store has a call and turns for the links to reach."""
    async with TwilioCaller(twilio_url(base), token=TOKEN) as caller:
        await caller.start()
        said = await caller.say(speech("What is the capital of France?"))
        assert await caller.wait(lambda r: r.media_after(said.ended), 60)
        await caller.hang_up()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base URL, log file) of a real server with the token set, after one call."""
    tmp = tmp_path_factory.mktemp("fuzz")
    log = tmp / "serve.log"
    with running_server("--set", f"server.token={TOKEN}", "--set", f"paths.runs_dir={tmp}",
                        log_path=log) as base:
        asyncio.run(_one_call(base))
        yield base, log


# A test per operation through pytest's own parametrize: schemathesis' `parametrize()` gives its
# tests one node id, and pytest-xdist's per-module scheduling would then run only one of them.
OPERATIONS = [result.ok() for result in schema.exclude(path_regex=NOT_FUZZED).get_all_operations()]


@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda operation: operation.label)
def test_no_route_answers_generated_input_with_a_server_error(operation, server):
    base, _log = server

    @given(case=operation.as_strategy())
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    def fuzz(case):
        response = case.call(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"},
                             timeout=60)
        _check(case, response)

    fuzz()


def _check(case, response) -> None:
    """No server error (but a documented busy or loading), and the documented error shape."""
    if response.status_code == 503 and "retry-after" in response.headers:
        # documented: every call slot taken (the fuzz's offers start calls), or loading
        assert "busy" in response.json()["detail"] or "loading" in response.json()["detail"]
        ANSWERS["503 busy"] += 1
        return
    ANSWERS[f"{response.status_code // 100}xx"] += 1
    case.validate_response(response, checks=[not_a_server_error])
    if 400 <= response.status_code < 500:
        body = response.json()
        if case.path.startswith("/v1/"):  # OpenAI's shape, what its clients parse
            assert isinstance(body["error"]["message"], str), body
        else:
            assert isinstance(body["detail"], str | list), body


def test_the_links_lead_from_the_calls_to_a_call_and_its_turns(server):
    base, _log = server
    machine = schema.exclude(path_regex=NOT_FUZZED).as_state_machine()
    followed = []

    class Links(machine):
        def get_call_kwargs(self, case):
            return {"base_url": base, "headers": {"Authorization": f"Bearer {TOKEN}"},
                    "timeout": 60}

        def validate_response(self, response, case, **kwargs):
            if case.path == "/api/calls/{call_id}" and response.status_code == 200:
                followed.append(case.path_parameters["call_id"])
            _check(case, response)

    Links.run(settings=settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                                suppress_health_check=list(HealthCheck), stateful_step_count=6))
    assert followed  # a real call's id reached its route through the link


def test_the_fuzzed_server_logged_no_unhandled_exception(server):
    _base, log = server
    print(f"api fuzz: {sum(ANSWERS.values())} requests, answers {dict(sorted(ANSWERS.items()))}")
    text = log.read_text(errors="replace")
    assert not UNHANDLED.search(text), text[-4000:]


def test_the_document_describes_every_request_body():
    for path, method in BODIES:
        body = schema.raw_schema["paths"][path][method]["requestBody"]["content"]
        assert body["application/json"]["schema"]["$ref"].startswith("#/components/schemas/")
