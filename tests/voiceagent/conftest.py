import uuid

import pytest

from tests.llm_engine.tiny_models import make_model, make_tokenizer
from tests.voiceagent.postgres import PostgresServer, pg_bin
from tests.voiceagent.serving import server_config
from voiceagent.pipeline.builder import load_shared


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """The embedded models, loaded once for the whole run (13 s a load on 2 cores) and shared by
    every pipeline and server test whose config differs only in per-call settings (VAD timing,
    turn-taking, store, limits). A test that breaks them takes `own_models`."""
    loaded = load_shared(server_config(tmp_path_factory.mktemp("m")), progress=lambda _: None)
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def own_models(tmp_path_factory):
    """The embedded models for one module alone: for tests that kill the engine's worker."""
    loaded = load_shared(server_config(tmp_path_factory.mktemp("m")), progress=lambda _: None)
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def tokenizer():
    """A tiny tokenizer and random-weight model for the LLM service's tests."""
    return make_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return make_model(len(tokenizer))


def _postgres():
    bin_dir = pg_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (no initdb): `scripts/setup.sh --dev` installs it")
    server = PostgresServer(bin_dir)
    try:
        server.start()
        yield server
    finally:
        server.remove()


@pytest.fixture(scope="session")
def postgres_server():
    """A real PostgreSQL server for the session, in a temporary directory; stopped at the end."""
    yield from _postgres()


@pytest.fixture
def own_postgres_server():
    """A server of the test's own, for a test that stops and starts it."""
    yield from _postgres()


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """A fresh, empty database of the session's server."""
    return postgres_server.create_database(f"test_{uuid.uuid4().hex[:12]}")
