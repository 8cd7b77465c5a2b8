import pytest

from tests.llm_engine.tiny_models import make_model, make_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def target(tokenizer):
    return make_model(len(tokenizer), seed=0)


@pytest.fixture(scope="session")
def draft(tokenizer):
    """A different random model: it mostly disagrees with the target."""
    return make_model(len(tokenizer), seed=1, layers=1, hidden=32)
