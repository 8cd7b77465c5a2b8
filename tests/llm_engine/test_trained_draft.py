"""The trained drafts (compact and EAGLE) on the real embedded target: lossless greedy and
sampling, and refused for another target."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import PreTrainedModel

from llm_engine.config import EngineConfig, SamplingConfig, SpeculationConfig
from llm_engine.engine import SpeculativeEngine
from llm_engine.errors import IncompatiblePairError
from llm_engine.prompts import encode_chat
from llm_engine.verify import VerifyResult, verify_sampling
from tests.llm_engine.test_smollm2 import PROMPTS
from voiceagent.llm_setup import load_draft, load_eagle

pytestmark = pytest.mark.slow

SAMPLES = 20_000
TOP = 12  # tokens of p compared one by one; the rest of the vocabulary is one bucket
# Correct samplers land near 0.01 here; one that keeps every draft token lands above 0.1.
TV_BOUND = 0.03


SHIPPED = EngineConfig(draft="smollm2-135m-draft", eagle="smollm2-135m-eagle")
LOADERS = {
    "draft": lambda target, engine=SHIPPED: load_draft(engine, target, "", lambda _: None),
    "eagle": lambda target, engine=SHIPPED: load_eagle(engine, target, lambda _: None),
}


@pytest.fixture(scope="module", params=["draft", "eagle"])
def method(request):
    return request.param


@pytest.fixture(scope="module")
def draft(smollm2, method):
    return LOADERS[method](smollm2).model


def _run(smollm2, costs, draft, method: str, prompt: str, sampling: SamplingConfig, **spec
         ) -> list:
    config = EngineConfig(speculation=SpeculationConfig(method=method, **spec), sampling=sampling)
    models = {"draft_model" if isinstance(draft, PreTrainedModel) else "eagle_head": draft}
    engine = SpeculativeEngine(smollm2.model, smollm2.tokenizer, config, cost_model=costs,
                               **models)
    state = engine.start(encode_chat(smollm2.tokenizer, [{"role": "user", "content": prompt}]))
    while not state.finished:
        engine.step(state)
    engine.release(state)
    return state.output_ids


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_with_the_trained_draft_equals_greedy_off(smollm2, smollm2_costs, draft, method,
                                                        prompt):
    sampling = SamplingConfig(max_new_tokens=40)
    off = _run(smollm2, smollm2_costs, draft, "off", prompt, sampling)
    assert _run(smollm2, smollm2_costs, draft, method, prompt, sampling, gate=False) == off


def _next_token_distributions(smollm2, draft, method, temperature: float = 0.8):
    """The target's (p) and the draft's (q) distributions of the same next token."""
    ids = torch.tensor([encode_chat(smollm2.tokenizer,
                                    [{"role": "user", "content": PROMPTS[0]}])])
    with torch.inference_mode():
        out = smollm2.model(ids, output_hidden_states=True)
        p = torch.softmax(out.logits[0, -1] / temperature, -1)  # [vocab]
        if method == "eagle":  # (f_i, t_{i+1}) for i < n - 1: its last output scores token n
            f = out.hidden_states[-1][:, :-1]  # [1, n - 1, hidden]
            last = draft.logits(draft(f, ids[:, 1:]))[0, -1]
        else:
            last = draft(ids).logits[0, -1]
        q = torch.softmax(last / temperature, -1)  # [vocab], 0 off-head
    return p, q


def _output_tv(p, q, sampler) -> float:
    """Total variation between p and the first committed token of one-token draft steps."""
    gen = torch.Generator().manual_seed(0)
    top = torch.topk(p, TOP).indices
    bucket = torch.full((len(p),), TOP, dtype=torch.long)
    bucket[top] = torch.arange(TOP)
    counts = torch.zeros(TOP + 1)
    pp = torch.stack([p, p])  # [2, vocab]: position 0 and the bonus position
    # The drafts, iid from q, drawn at once: a draw over the vocabulary costs ~0.8 ms each.
    drafts = torch.multinomial(q, SAMPLES, replacement=True, generator=gen)  # [SAMPLES]
    for d in drafts.split(1):
        counts[bucket[sampler(d, q[None], pp, gen).tokens[0]]] += 1
    expected = torch.zeros(TOP + 1).index_add_(0, bucket, p)
    return 0.5 * (counts / SAMPLES - expected).abs().sum().item()


def test_sampling_with_the_trained_draft_follows_the_target(smollm2, draft, method):
    p, q = _next_token_distributions(smollm2, draft, method)
    assert _output_tv(p, q, verify_sampling) < TV_BOUND


def test_the_distribution_check_catches_a_sampler_that_keeps_the_draft(smollm2, draft, method):
    def keep_draft(d, q, p, gen):
        return VerifyResult(d.tolist(), 1, None)

    p, q = _next_token_distributions(smollm2, draft, method)
    assert _output_tv(p, q, keep_draft) > TV_BOUND


def test_a_draft_trained_for_another_target_is_refused(smollm2, method):
    other = replace(smollm2, file_sha256="0" * 64)
    with pytest.raises(IncompatiblePairError, match="trained for a target"):
        LOADERS[method](other)
