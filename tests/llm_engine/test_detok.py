"""Incremental detokenisation and stop strings."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from llm_engine import detok as detok_module
from llm_engine.detok import IncrementalDetokenizer, StopMatcher
from tests.llm_engine.tiny_models import CORPUS

TEXTS = sorted(set(CORPUS)) + [
    "Zażółć gęślą jaźń 🙂🙂 👩‍👩‍👧 ok",
    "€€€ 漢字テスト  double  spaces\n\nnew line",
]


def make_sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-2-style: '▁' word marks, byte fallback for rare characters, leading space stripped."""
    meta = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = meta
    base.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False, limit_alphabet=50)
    )
    spec = json.loads(base.to_str())["model"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]  # ordinary vocab, not special
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *byte_tokens])}
    for t in sorted(spec["vocab"], key=spec["vocab"].get):
        vocab.setdefault(t, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = meta
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module")
def sp_tokenizer():
    return make_sentencepiece_tokenizer()


def stream(tokenizer, ids, rng, prompt_ids=None, max_batch=4) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids)
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_batch)
        deltas.append(detok.push(ids[i : i + n]))
        i += n
    return [*deltas, detok.flush()]


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def random_text_ids(tokenizer, rng) -> list[int]:
    ids = tokenizer.encode(" ".join(rng.sample(TEXTS, 3)), add_special_tokens=False)
    ids.insert(rng.randrange(len(ids)), tokenizer.eos_token_id)  # skipped when decoding
    return ids


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_deltas_concatenate_to_decode_for_random_batches(kind, tokenizer, sp_tokenizer):
    tok = tokenizer if kind == "byte_level" else sp_tokenizer
    rng = random.Random(0)
    for _ in range(200):
        ids = random_text_ids(tok, rng)
        assert "".join(stream(tok, ids, rng)) == decode(tok, ids)


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_no_replacement_char_is_emitted_mid_stream_for_valid_text(kind, tokenizer, sp_tokenizer):
    tok = tokenizer if kind == "byte_level" else sp_tokenizer
    rng = random.Random(1)
    for _ in range(200):
        deltas = stream(tok, random_text_ids(tok, rng), rng, max_batch=2)
        assert not any("\ufffd" in d for d in deltas)


def test_incomplete_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("ok 🙂", add_special_tokens=False)
    partial = [i for i in range(1, len(ids)) if decode(tokenizer, ids[:i]).endswith("\ufffd")]
    assert partial, "the emoji should span several byte-level tokens"
    detok = IncrementalDetokenizer(tokenizer)
    out = [detok.push([t]) for t in ids]
    assert not any("\ufffd" in d for d in out)
    assert all("🙂" not in d for d in out[:-1]) and out[-1] == "🙂"


def test_text_before_an_incomplete_character_is_not_delayed(tokenizer):
    ids = tokenizer.encode("ok 🙂", add_special_tokens=False)
    cut = next(i for i in range(1, len(ids)) if decode(tokenizer, ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer)
    stable = decode(tokenizer, ids[:cut]).rstrip("\ufffd")
    assert detok.push(ids[:cut]) == stable


def test_flush_releases_an_incomplete_tail_as_decode_shows_it(tokenizer):
    ids = tokenizer.encode("ok 🙂", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids) + detok.flush() == decode(tokenizer, ids)


def test_sentencepiece_word_spaces_survive_one_token_pushes(sp_tokenizer):
    ids = sp_tokenizer.encode("Hello, how can I help you today?", add_special_tokens=False)
    detok = IncrementalDetokenizer(sp_tokenizer)
    out = [detok.push([t]) for t in ids]
    assert "".join(out) == "Hello, how can I help you today?"
    assert any(d.startswith(" ") for d in out)  # spaces arrive with the following word


def test_prompt_ids_keep_the_leading_space_of_the_first_generated_word(sp_tokenizer):
    prompt = sp_tokenizer.encode("Thank you for", add_special_tokens=False)
    reply = sp_tokenizer.encode("Thank you for calling", add_special_tokens=False)[len(prompt) :]
    detok = IncrementalDetokenizer(sp_tokenizer, prompt_ids=prompt)
    assert detok.push(reply) + detok.flush() == " calling"


def test_special_tokens_are_kept_when_asked(tokenizer):
    ids = [*tokenizer.encode("Hi", add_special_tokens=False), tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert detok.push(ids[:1]) + detok.push(ids[1:]) == "Hi<|im_end|>"


def test_random_ids_match_decode_for_byte_level(tokenizer):
    # A random model emits invalid UTF-8 too; the stream must still agree with decode.
    rng = random.Random(2)
    for _ in range(100):
        ids = [rng.randrange(len(tokenizer)) for _ in range(100)]
        assert "".join(stream(tokenizer, ids, rng)) == decode(tokenizer, ids)


def test_each_push_decodes_a_bounded_window(tokenizer):
    lengths = []

    class Recording:
        def decode(self, ids, **kw):
            lengths.append(len(ids))
            return tokenizer.decode(ids, **kw)

    ids = tokenizer.encode(" ".join(TEXTS * 10), add_special_tokens=False)
    detok = IncrementalDetokenizer(Recording())
    text = "".join(detok.push([t]) for t in ids) + detok.flush()
    assert text == decode(tokenizer, ids) and len(ids) > 1000
    assert max(lengths) < 40  # a window of recent tokens, not the whole text


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_window_resync_after_many_held_tokens_keeps_text_exact(
    kind, tokenizer, sp_tokenizer, monkeypatch
):
    tok = tokenizer if kind == "byte_level" else sp_tokenizer
    monkeypatch.setattr(detok_module, "MAX_HELD_TOKENS", 8)
    calls = []
    real = IncrementalDetokenizer._resync
    monkeypatch.setattr(
        IncrementalDetokenizer, "_resync", lambda self, *a: calls.append(1) or real(self, *a)
    )
    rng = random.Random(3)
    for _ in range(200):
        ids = random_text_ids(tok, rng)
        assert "".join(stream(tok, ids, rng, max_batch=5)) == decode(tok, ids)
    assert calls, "long runs ending mid-character should have triggered a resync"


def test_stop_spanning_two_deltas_is_cut_before_it():
    stops = StopMatcher(["</answer>"])
    assert stops.feed("The total is 42</ans") == ("The total is 42", False)
    assert stops.feed("wer> and more") == ("", True)
    assert stops.stop == "</answer>"


def test_partial_stop_prefix_is_held_then_released_when_not_a_stop():
    stops = StopMatcher(["STOP"])
    assert stops.feed("go ST") == ("go ", False)
    assert stops.feed("ILL here") == ("STILL here", False)


def test_held_partial_is_released_by_flush_when_the_stream_ends():
    stops = StopMatcher(["STOP"])
    assert stops.feed("almost STO") == ("almost ", False)
    assert stops.flush() == "STO"


def test_earliest_of_several_stops_wins():
    stops = StopMatcher(["world", "lo w"])
    assert stops.feed("hello world") == ("hel", True)
    assert stops.stop == "lo w"


def test_nothing_is_emitted_after_a_stop():
    stops = StopMatcher(["\n\n"])
    assert stops.feed("a\n\nb") == ("a", True)
    assert stops.feed("more") == ("", True) and stops.flush() == ""


def test_stop_inside_one_delta_from_the_detokenizer(tokenizer):
    ids = tokenizer.encode("Thank you for calling. Your appointment", add_special_tokens=False)
    detok, stops, out = IncrementalDetokenizer(tokenizer), StopMatcher([". Your"]), ""
    for t in ids:
        text, stopped = stops.feed(detok.push([t]))
        out += text
        if stopped:
            break
    assert out == "Thank you for calling" and stopped


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError):
        StopMatcher([""])
