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


@pytest.fixture(params=["own", "torch"])
def int_kernel_choice(request):
    """Our own CPU kernels (the q4/q8 products and the layer ops, where they run) and torch's,
    in turn, for layers built in the test."""
    from llm_engine.lean import int_kernel

    if request.param == "own" and not int_kernel.available():
        pytest.skip("our own CPU kernels do not run here (no AVX512-VNNI, or no compiler)")
    before = int_kernel.wanted()
    int_kernel.use(request.param == "own")
    yield request.param
    int_kernel.use(before)
