import pytest

from tests.voiceagent.serving import server_config
from voiceagent.pipeline.builder import load_shared


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The embedded models, loaded once per server test module and shared by its servers."""
    loaded = load_shared(server_config(tmp_path_factory.mktemp("m")), progress=lambda _: None)
    yield loaded
    loaded.close()
