"""The lean forward's attention dtype is measured once per machine and cached, so every process
on a machine attends alike and says the same things (`voiceagent.llm_setup._attention_dtype`)."""

from __future__ import annotations

import json

import torch

from llm_engine.cost_model import CostModelCache
from tests.llm_engine.tiny_models import make_model, make_tokenizer
from voiceagent.llm_setup import _attention_dtype


def test_the_attention_dtype_is_measured_once_and_then_read_from_the_cache(tmp_path):
    model = make_model(len(make_tokenizer()), seed=0)
    cache = CostModelCache(tmp_path)
    first = _attention_dtype(model, "q4", 6, cache)
    records = list(tmp_path.glob("*.json"))
    assert len(records) == 1
    record = json.loads(records[0].read_text())
    assert record["chosen"] == str(first).removeprefix("torch.")
    # Another process reads the record instead of measuring: what it says is what it gets.
    other = torch.bfloat16 if first == torch.float32 else torch.float32
    record["chosen"] = str(other).removeprefix("torch.")
    records[0].write_text(json.dumps(record))
    assert _attention_dtype(model, "q4", 6, cache) == other
    _attention_dtype(model, "int8", 6, cache)  # another format: its own record
    assert len(list(tmp_path.glob("*.json"))) == 2
