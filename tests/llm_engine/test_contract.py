"""The draft/target compatibility contract and the pair card."""

from __future__ import annotations

import json
import re
import struct

import pytest

from llm_engine.config import EngineConfig, SpeculationConfig
from llm_engine.contract import (
    IncompatiblePairError,
    check_lm_heads,
    check_pair,
    make_pair_card,
)
from llm_engine.loading import LoadedModel
from llm_engine.pair_card import PairCard, find_licence
from tests.llm_engine.tiny_models import make_model, make_tokenizer

OTHER_CORPUS = ["Completely different words for another vocabulary, zebra quartz."] * 20


def loaded(name, model, tokenizer, source="/models/x", gguf_file=None) -> LoadedModel:
    return LoadedModel(
        name=name,
        source=source,
        gguf_file=gguf_file,
        revision=None,
        file_sha256=None,
        model=model,
        tokenizer=tokenizer,
        device="cpu",
        dtype="float32",
        param_bytes=sum(p.numel() * 4 for p in model.parameters()),
        load_s=0.1,
        from_cache=False,
    )


@pytest.fixture(scope="module")
def pair(tokenizer):
    target = loaded("tiny-target", make_model(len(tokenizer), seed=0), tokenizer)
    draft = loaded("tiny-draft", make_model(len(tokenizer), seed=1, layers=1), make_tokenizer())
    return target, draft


def test_identical_tokenizers_are_accepted(tokenizer):
    check_pair(tokenizer, make_tokenizer())


def test_mismatched_vocabulary_is_refused_with_first_differences(tokenizer):
    other = make_tokenizer(vocab_size=300, corpus=OTHER_CORPUS)
    with pytest.raises(IncompatiblePairError) as err:
        check_pair(tokenizer, other, names=("big", "small"))
    msg = str(err.value)
    assert "draft 'small' is not compatible with target 'big'" in msg
    assert f"big has {len(tokenizer)} tokens, small has {len(other)}" in msg
    # The first differing entries by id are shown with both ids (or 'missing').
    assert re.search(r"\n  '.+': big id (\d+|missing), small id (\d+|missing)", msg)


def test_differing_eos_is_refused(tokenizer):
    other = make_tokenizer()
    other.eos_token = "<|endoftext|>"
    with pytest.raises(IncompatiblePairError, match=r"eos_token: target '<\|im_end\|>' \(id 2\)"):
        check_pair(tokenizer, other)


def test_differing_chat_template_is_refused_with_position(tokenizer):
    other = make_tokenizer()
    other.chat_template = other.chat_template.replace("<|im_start|>", "<s>", 1)
    with pytest.raises(IncompatiblePairError) as err:
        check_pair(tokenizer, other)
    msg = str(err.value)
    assert "chat template 'default': first difference at line 1, column 31" in msg
    assert "rendered probe differs" in msg and "<s>user" in msg


def test_template_text_difference_that_renders_the_same_is_accepted(tokenizer):
    # Llama 3.1 vs 3.2 differ this way: same output, different template source.
    other = make_tokenizer()
    other.chat_template = "{#- a comment -#}" + other.chat_template
    check_pair(tokenizer, other)


def test_padded_embedding_rows_are_accepted(tokenizer):
    # Like Qwen2.5-7B (152064 rows) + 0.5B (151936 rows) over one 151665-token tokenizer.
    n = len(tokenizer)
    check_lm_heads(tokenizer, make_model(n + 48), make_model(n + 16, layers=1))


def test_draft_lm_head_smaller_than_tokenizer_is_refused(tokenizer):
    n = len(tokenizer)
    with pytest.raises(IncompatiblePairError, match=f"draft lm_head has {n - 1} rows"):
        check_lm_heads(tokenizer, make_model(n), make_model(n - 1, layers=1))


def test_make_pair_card_refuses_an_incompatible_pair(pair):
    target, _ = pair
    other_tok = make_tokenizer(vocab_size=300, corpus=OTHER_CORPUS)
    bad = loaded("other", make_model(len(other_tok), layers=1), other_tok)
    config = EngineConfig(speculation=SpeculationConfig(method="draft"))
    with pytest.raises(IncompatiblePairError, match="'other' is not compatible"):
        make_pair_card(target, bad, config, resident_bytes=1)


def test_pair_card_json_round_trip(pair):
    target, draft = pair
    config = EngineConfig(speculation=SpeculationConfig(method="draft"))
    card = make_pair_card(target, draft, config, resident_bytes=12345)
    again = PairCard.from_json(card.to_json())
    assert again == card
    data = json.loads(card.to_json())
    assert data["draft"]["name"] == "tiny-draft" and data["resident_bytes"] == 12345
    assert data["compatibility"]["status"] == "compatible"


def test_pair_card_hash_is_stable_and_ignores_created_at(pair):
    target, draft = pair
    config = EngineConfig(speculation=SpeculationConfig(method="draft"))
    one = make_pair_card(target, draft, config, resident_bytes=1)
    two = make_pair_card(target, draft, config, resident_bytes=1)
    two.created_at = "2000-01-01T00:00:00+00:00"
    assert one.card_hash == two.compute_hash() == one.compute_hash()
    config.speculation.num_draft_tokens += 1  # any setting change is a new card
    assert make_pair_card(target, draft, config, resident_bytes=1).card_hash != one.card_hash


def test_edited_pair_card_is_refused(pair):
    target, draft = pair
    card = make_pair_card(target, draft, EngineConfig(), resident_bytes=1)
    data = card.to_dict()
    data["max_context"] += 1
    with pytest.raises(ValueError, match="does not match its card_hash"):
        PairCard.from_dict(data)


def test_ngram_card_records_no_draft_model(pair):
    target, _ = pair
    card = make_pair_card(target, None, EngineConfig(), resident_bytes=1)
    assert card.draft is None
    assert card.proposer["method"] == "ngram" and "prompt lookup" in card.proposer["draft_model"]
    assert card.compatibility["status"].startswith("not applicable")
    assert "output is unchanged" in card.fallback


def _write_gguf(path, fields: dict[str, str]) -> None:
    def gguf_str(s: str) -> bytes:
        return struct.pack("<Q", len(s.encode())) + s.encode()

    body = b"GGUF" + struct.pack("<IQQ", 3, 0, len(fields) + 1)
    body += gguf_str("general.alignment") + struct.pack("<II", 4, 32)  # a scalar to skip
    for key, value in fields.items():
        body += gguf_str(key) + struct.pack("<I", 8) + gguf_str(value)
    path.write_bytes(body)


def test_licence_is_read_from_gguf_metadata(tmp_path, tokenizer):
    path = tmp_path / "m.gguf"
    _write_gguf(path, {"general.name": "tiny", "general.license": "apache-2.0"})
    model = loaded("m", make_model(len(tokenizer), layers=1), tokenizer, str(path), "m.gguf")
    assert find_licence(model) == "apache-2.0"


def test_licence_is_read_from_model_card_front_matter(tmp_path, tokenizer):
    (tmp_path / "README.md").write_text("---\nlibrary_name: transformers\nlicense: mit\n---\n# x")
    model = loaded("m", make_model(len(tokenizer), layers=1), tokenizer, str(tmp_path))
    assert find_licence(model) == "mit"
