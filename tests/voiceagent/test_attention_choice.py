"""What the engine measures about the machine at load, the lean runner's attention dtype, the
invariance probe's answer and the engine's threads, is measured once per machine and cached, so
every process on a machine runs alike and says the same things (`voiceagent.llm_setup`)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time

import torch

from llm_engine import threads
from llm_engine.config import EngineConfig, SpeculationConfig
from llm_engine.cost_model import CostModelCache
from llm_engine.loading import LoadedModel
from llm_engine.runner import EagerRunner
from llm_engine.threads import Load
from tests.llm_engine.tiny_models import make_model, make_tokenizer
from voiceagent.llm_setup import _attention_dtype, _choose_threads, make_runner


def _records(folder, part: str) -> list:
    return [p for p in folder.glob("*.json") if json.loads(p.read_text())["key"]["part"] == part]


def test_the_attention_dtype_is_measured_once_and_then_read_from_the_cache(tmp_path):
    model = make_model(len(make_tokenizer()), seed=0)
    cache = CostModelCache(tmp_path)
    first = _attention_dtype(model, "q4", 6, cache)
    records = _records(tmp_path, "attention")
    assert len(records) == 1
    record = json.loads(records[0].read_text())
    assert record["chosen"] == str(first).removeprefix("torch.")
    # Another process reads the record instead of measuring: what it says is what it gets.
    other = torch.bfloat16 if first == torch.float32 else torch.float32
    record["chosen"] = str(other).removeprefix("torch.")
    records[0].write_text(json.dumps(record))
    assert _attention_dtype(model, "q4", 6, cache) == other
    _attention_dtype(model, "int8", 6, cache)  # another format: its own record
    assert len(_records(tmp_path, "attention")) == 2


def test_the_invariance_probe_runs_once_and_a_later_runner_takes_its_answer(tmp_path):
    tokenizer = make_tokenizer()
    model = make_model(len(tokenizer), seed=0)
    target = LoadedModel("tiny", "tiny", None, None, None, model, tokenizer, "cpu", "float32",
                         0, 0.0, False)
    config = EngineConfig(runner="lean", max_context=256,
                          speculation=SpeculationConfig(max_draft_tokens=5))
    cache = CostModelCache(tmp_path)
    probed = make_runner(config, target, "q4", cache)
    (record,) = _records(tmp_path, "invariance")
    saved = json.loads(record.read_text())
    assert {k: saved[k] for k in probed.probe_result} == probed.probe_result
    # What the record says is what the next runner runs (here a padding it would not choose).
    record.write_text(json.dumps({**saved, "attention_rows": 3}))
    assert make_runner(config, target, "q4", cache).lean.attention_rows == 3


def test_the_engine_threads_are_measured_once_beside_their_load_and_then_read(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setattr(threads, "candidates", lambda: [1, 2])
    monkeypatch.setattr(threads, "other_work", lambda: 0.3)
    before = torch.get_num_threads()
    tokenizer = make_tokenizer()
    target = LoadedModel("tiny", "tiny", None, None, None, make_model(len(tokenizer), seed=0),
                         tokenizer, "cpu", "float32", 0, 0.0, False)
    runner, cache, said = EagerRunner(target.model), CostModelCache(tmp_path), []
    ran = []
    load = Load("a test load", lambda: contextlib.nullcontext(ran.append(1)))
    try:
        first = _choose_threads(EngineConfig(), runner, target, cache, load, said.append)
        assert ran == [1] and torch.get_num_threads() == first["chosen"]
        (record,) = _records(tmp_path, "threads")
        assert json.loads(record.read_text())["key"]["beside"] == "a test load"
        # Another process reads the record instead of measuring: what it says is what it gets.
        record.write_text(json.dumps({**json.loads(record.read_text()), "chosen": 1}))
        assert _choose_threads(EngineConfig(), runner, target, cache, load, said.append) \
            ["chosen"] == 1
        assert ran == [1] and torch.get_num_threads() == 1
        assert sum("measuring" in line for line in said) == 1
        # A set count, or nothing beside: not this record.
        assert _choose_threads(EngineConfig(threads=2), runner, target, cache, load,
                               said.append) is None
        _choose_threads(EngineConfig(), runner, target, cache, None, said.append)
        assert len(_records(tmp_path, "threads")) == 2
    finally:
        torch.set_num_threads(before)


def test_threads_measured_beside_more_other_work_are_measured_again(tmp_path, monkeypatch):
    monkeypatch.setattr(threads, "candidates", lambda: [1, 2])
    tokenizer = make_tokenizer()
    target = LoadedModel("tiny", "tiny", None, None, None, make_model(len(tokenizer), seed=0),
                         tokenizer, "cpu", "float32", 0, 0.0, False)
    runner, cache, said = EagerRunner(target.model), CostModelCache(tmp_path), []

    def measured() -> int:
        return sum("measuring the engine's step" in line for line in said)

    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(threads, "other_work", lambda: 0.7)  # a test run beside it
        _choose_threads(EngineConfig(), runner, target, cache, None, said.append)
        (record,) = _records(tmp_path, "threads")
        assert json.loads(record.read_text())["other_work"] == 0.7
        # as busy, busier, or less than BUSIER less busy now: the record stands
        for now in (0.7, 1.9, 0.21):
            monkeypatch.setattr(threads, "other_work", lambda now=now: now)
            _choose_threads(EngineConfig(), runner, target, cache, None, said.append)
        assert measured() == 1
        # half a core less: measured again, and the new record says beside how much
        monkeypatch.setattr(threads, "other_work", lambda: 0.2)
        _choose_threads(EngineConfig(), runner, target, cache, None, said.append)
        assert any("beside other work (0.7 cores then, 0.2 now)" in line for line in said)
        assert measured() == 2 and json.loads(record.read_text())["other_work"] == 0.2
        # a record that does not say (written before it was kept): measured again, once
        data = json.loads(record.read_text())
        del data["other_work"]
        record.write_text(json.dumps(data))
        _choose_threads(EngineConfig(), runner, target, cache, None, said.append)
        _choose_threads(EngineConfig(), runner, target, cache, None, said.append)
        assert measured() == 3
    finally:
        torch.set_num_threads(before)


def test_other_work_counts_another_processs_busy_core():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        assert threads.other_work(0.5) >= 0.5  # a core's worth, less what others took of it
    finally:
        busy.kill()
        busy.wait()
