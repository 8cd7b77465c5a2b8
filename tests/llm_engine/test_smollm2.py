"""The engine on the real embedded target (SmolLM2-135M-Instruct): losslessness end to end."""

import pytest

from llm_engine.config import EngineConfig, SamplingConfig, SpeculationConfig
from llm_engine.engine import SpeculativeEngine
from llm_engine.prompts import encode_chat

PROMPTS = [
    "What is the capital of France?",
    "Please repeat after me: the pool is closed on Monday and Tuesday for cleaning.",
    "My order number is 48213 and it has not arrived. Can you check order 48213?",
    'Reply with JSON only: {"tool": "get_weather", "arguments": {"city": "Paris"}}',
    "Tell me a short fact about the moon.",
]


def _generate(model, costs, method: str, prompt: str, max_new: int = 40, **spec
              ) -> tuple[list, object]:
    config = EngineConfig(
        speculation=SpeculationConfig(method=method, **spec),
        sampling=SamplingConfig(max_new_tokens=max_new),
    )
    engine = SpeculativeEngine(model.model, model.tokenizer, config, draft_model=model.model,
                               cost_model=costs)
    state = engine.start(encode_chat(model.tokenizer, [{"role": "user", "content": prompt}]))
    while not state.finished:
        engine.step(state)
    engine.release(state)
    return state.output_ids, state.stats


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_ngram_equals_greedy_off(smollm2, smollm2_costs, prompt):
    off, _ = _generate(smollm2, smollm2_costs, "off", prompt)
    ngram, _ = _generate(smollm2, smollm2_costs, "ngram", prompt, gate=False)
    assert ngram == off


def test_target_as_its_own_draft_accepts_everything(smollm2, smollm2_costs):
    k = 3
    _, stats = _generate(
        smollm2, smollm2_costs, "draft", PROMPTS[0], max_new=24, num_draft_tokens=k,
        adaptive=False, gate=False)
    assert stats.accepted == stats.drafted > 0
    # K+1 tokens per step (K accepted + the bonus), except a last step cut by EOS or the budget.
    assert all(s.committed == s.drafted + 1 == k + 1 for s in stats.steps[:-1])
