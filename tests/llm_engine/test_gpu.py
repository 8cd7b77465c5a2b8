"""GPU checks: skipped cleanly without CUDA (CI has none)."""

import pytest
import torch

from llm_engine.config import EngineConfig, SamplingConfig, SpeculationConfig
from llm_engine.engine import SpeculativeEngine
from llm_engine.loading import pick_device, pick_dtype

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_auto_picks_cuda_and_bf16():
    device = pick_device("auto")
    assert device.type == "cuda"
    assert pick_dtype("auto", device) in (torch.bfloat16, torch.float16)


def test_greedy_draft_on_cuda_equals_plain_decoding(tokenizer, target, draft):
    cuda_target, cuda_draft = target.to("cuda"), draft.to("cuda")
    try:
        prompt = tokenizer.encode("Hello, how can I help you today?")

        def run(method):
            config = EngineConfig(
                speculation=SpeculationConfig(method=method, gate=False),
                sampling=SamplingConfig(max_new_tokens=32),
            )
            engine = SpeculativeEngine(cuda_target, tokenizer, config, draft_model=cuda_draft)
            return [t for step in engine.generate(prompt) for t in step]

        assert run("draft") == run("off")
    finally:
        target.to("cpu"), draft.to("cpu")
