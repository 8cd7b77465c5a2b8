import os
import time
from pathlib import Path

import pytest
import torch

from llm_engine.errors import ModelLoadError
from llm_engine.loading import load_causal_lm, pick_dtype, servable_folder
from voiceagent.models import resolve


def test_hf_folder_round_trip(tmp_path, tokenizer, target):
    target.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    m = load_causal_lm(str(tmp_path), device="cpu", dtype="auto", progress=lambda _: None)
    assert m.gguf_file is None and m.dtype == "float32" and m.device == "cpu"
    weights = sum(p.numel() * 4 for p in target.parameters())
    assert weights <= m.param_bytes < weights * 1.01  # plus small buffers (rotary inv_freq)
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(m.model(ids).logits, target(ids).logits)


def test_missing_path_is_one_line():
    with pytest.raises(ModelLoadError, match="model path does not exist: /no/such/model.gguf"):
        load_causal_lm("/no/such/model.gguf", progress=lambda _: None)


def test_hub_id_offline_says_so():
    with pytest.raises(ModelLoadError, match="offline .HF_HUB_OFFLINE=1."):
        load_causal_lm("someone/not-a-real-model", progress=lambda _: None)


def test_auto_dtype_is_fp32_on_cpu():
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert pick_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_gguf_is_dequantised_once_then_loaded_from_cache(tmp_path):
    gguf = resolve("smollm2-135m-instruct", "llm").location
    first = load_causal_lm(gguf, cache_dir=tmp_path, progress=lambda _: None)
    t0 = time.perf_counter()
    second = load_causal_lm(gguf, cache_dir=tmp_path, progress=lambda _: None)
    second_s = time.perf_counter() - t0
    assert not first.from_cache and second.from_cache
    assert first.file_sha256 == second.file_sha256
    assert second_s < first.load_s  # loose bound: catches a cache that is never hit
    ids = torch.tensor([[1, 504, 3458, 28]])
    assert torch.equal(first.model(ids).logits, second.model(ids).logits)
    assert second.tokenizer.chat_template == first.tokenizer.chat_template


def test_a_dequantisation_another_process_finished_first_is_used(tmp_path):
    """Two processes on a fresh machine (test workers, a rolling restart) de-quantise the same
    file at once: the one whose rename comes second keeps the first one's folder, no error; a
    dead process's partial folder is removed, a live one's kept."""
    messages: list[str] = []

    def progress(line: str) -> None:
        messages.append(line)
        if line.startswith("de-quantising"):  # "... (first run only; cached in <target>)"
            other = Path(line.rsplit("cached in ", 1)[1].rstrip(")"))
            other.mkdir(parents=True)
            (other / "config.json").write_text('{"by": "the other"}')  # while ours de-quantises
            # A dead process's partial folder (pids stop at 4194304), and a live one's.
            (other.parent / f"{other.name}.4194305.abc.partial").mkdir()
            (other.parent / f"{other.name}.{os.getppid()}.abc.partial").mkdir()

    folder = Path(servable_folder(resolve("smollm2-135m-instruct", "llm").location, tmp_path,
                                  progress))
    assert (folder / "config.json").read_text() == '{"by": "the other"}'
    assert any(m.startswith("another process de-quantised") for m in messages)
    # ours and the dead process's partial folders are gone; the live one's is its own
    assert sorted(p.name for p in folder.parent.iterdir()) == sorted(
        [folder.name, f"{folder.name}.{os.getppid()}.abc.partial"])


def test_gguf_dequantisation_draws_no_bar_when_transformers_bars_are_off(tmp_path, capfd):
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # as the CLI does off a terminal and under --log-json
    try:
        load_causal_lm(resolve("smollm2-135m-instruct", "llm").location, cache_dir=tmp_path,
                       progress=lambda _: None)
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
    assert "de-quantizing GGUF" not in capfd.readouterr().err
