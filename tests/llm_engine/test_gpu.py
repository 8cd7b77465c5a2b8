"""GPU checks: the engine on CUDA (marked `gpu`, skipped without it; CI has none), and the GPU
bench (scripts/gpu_bench.py) at a tiny shape on a CPU, so that it still runs when a GPU is lent.
scripts/gpu_check.sh runs this file and the other `gpu` tests on a GPU machine."""

import importlib.util
import json
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

from llm_engine.config import EngineConfig, SamplingConfig, SpeculationConfig
from llm_engine.engine import SpeculativeEngine
from llm_engine.loading import pick_device, pick_dtype

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BENCH = Path(__file__).resolve().parents[2] / "scripts" / "gpu_bench.py"
PROMPT = "Hello, how can I help you today? " * 3  # repeats itself, so the n-gram lookup drafts


@pytest.fixture
def on_cuda(target, draft):
    """The session's tiny target and draft (float32), on the GPU for one test."""
    try:
        yield target.to("cuda"), draft.to("cuda")
    finally:
        target.to("cpu"), draft.to("cpu")


def greedy(target, tokenizer, method, draft=None):
    """All tokens of one greedy request, and the engine (for its totals)."""
    config = EngineConfig(
        speculation=SpeculationConfig(method=method, gate=False),
        sampling=SamplingConfig(max_new_tokens=32),
    )
    engine = SpeculativeEngine(target, tokenizer, config, draft_model=draft)
    tokens = [t for step in engine.generate(tokenizer.encode(PROMPT)) for t in step]
    return tokens, engine


@cache
def load_bench():
    """scripts/gpu_bench.py as a module (registered first: its dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location("gpu_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# -- on CUDA ------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_auto_picks_cuda_and_bf16():
    device = pick_device("auto")
    assert device.type == "cuda"
    assert pick_dtype("auto", device) in (torch.bfloat16, torch.float16)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("drafter", ["ngram", "draft model", "target itself"])
def test_greedy_speculation_on_cuda_equals_plain_decoding(tokenizer, on_cuda, drafter):
    target, draft = on_cuda
    method, model = {
        "ngram": ("ngram", None),
        "draft model": ("draft", draft),
        "target itself": ("draft", target),
    }[drafter]
    plain, _ = greedy(target, tokenizer, "off")
    tokens, engine = greedy(target, tokenizer, method, model)
    assert tokens == plain
    assert engine.totals.drafted > 0  # it really speculated


@pytest.mark.gpu
@needs_cuda
def test_target_as_its_own_draft_accepts_every_draft_on_cuda(tokenizer, on_cuda):
    target, _ = on_cuda
    _, engine = greedy(target, tokenizer, "draft", target)
    assert engine.totals.accepted == engine.totals.drafted > 0


@pytest.mark.gpu
@needs_cuda
def test_the_compiled_runner_with_cuda_graphs_matches_eager_on_cuda(on_cuda):
    from llm_engine.compiled_runner import CompiledRunner
    from llm_engine.runner import EagerRunner

    target, _ = on_cuda
    eager, compiled = EagerRunner(target), CompiledRunner(target, 128, buckets=(1, 4))
    e_cache, c_cache = eager.new_cache(), compiled.new_cache()
    prompt = torch.tensor([[5, 17, 99, 3, 250, 42, 7]], device="cuda")
    with torch.inference_mode():
        eager.forward(e_cache, prompt)
        compiled.forward(c_cache, prompt)
        for _ in range(3):  # graphs replay: the outputs must not alias one replay's buffer
            for rows in ([9], [9, 10, 11]):
                ids = torch.tensor([rows], device="cuda")
                want, got = eager.forward(e_cache, ids), compiled.forward(c_cache, ids)
                assert torch.allclose(got.logits, want.logits, atol=1e-3, rtol=1e-3)
                eager.crop(e_cache, 7)
                compiled.crop(c_cache, 7)


# -- the GPU bench, without a GPU ---------------------------------------------------------------


@pytest.mark.parametrize("name, tbps", [
    ("NVIDIA H200", 4.8),
    ("NVIDIA H100 80GB HBM3", 3.35),
    ("NVIDIA H100 PCIe", 2.0),
    ("NVIDIA A100-SXM4-80GB", 2.04),
    ("NVIDIA L4", 0.3),
    ("NVIDIA L40S", 0.864),  # not the L4's figure: "L4" is in its name
    ("NVIDIA GH200 480GB", 4.0),  # not the H200's
    ("A GPU not in the table", None),
])
def test_bench_looks_peak_bandwidth_up_by_device_name(name, tbps):
    assert load_bench().peak_tbps(name) == tbps


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_bench_without_cuda_says_skipped_and_succeeds(capsys):
    bench = load_bench()
    assert bench.main([]) == 0
    assert capsys.readouterr().out.strip() == bench.SKIPPED


def test_bench_dry_run_on_a_cpu_writes_its_table_and_json(tmp_path):
    bench = load_bench()
    args = ["--device", "cpu", "--tiny", "--prompt-tokens", "32", "--new-tokens", "12"]
    assert bench.main([*args, "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "gpu_bench.json").read_text())
    modes = {m["label"]: m for m in data["modes"]}
    assert list(modes) == ["off", "ngram", "draft", "draft, gated", "draft = target"]
    assert len(data["verify_ms"]) == bench.MAX_ROWS
    assert data["verify_ratios"][0] == 1.0
    # float32 greedy on a CPU: every mode is lossless, and the target agrees with itself.
    assert all(m["diverges_at"] is None for m in modes.values())
    assert modes["draft = target"]["acceptance"] == 1.0
    assert [m["acceptance"] for m in data["modelled"]] == list(bench.MODELLED_ACCEPTANCE)
    table = (tmp_path / "gpu_bench.md").read_text()
    assert "| draft = target | target itself |" in table
