"""`voiceagent bench cue`: labelled phrases scored by the pipeline's own cue, and what each
threshold gets wrong."""

import asyncio

import pytest

from voiceagent.bench.cue import (
    DEFAULT_PHRASES,
    _score_all,
    held,
    let_end,
    load_phrases,
    render,
    summarise,
)


def _row(label, logprob, held_by_words=False):
    return {"text": label, "words": label, "label": label, "logprob": logprob, "ms": 1.0,
            "held_by_words": held_by_words}


ROWS = [_row("finished", -0.5), _row("finished", -3.0), _row("finished", -9.0),
        _row("unfinished", -8.0), _row("unfinished", -12.0), _row("unfinished", -1.0, True)]


def test_a_threshold_holds_finished_messages_below_it_and_lets_fragments_above_it_end():
    assert [r["logprob"] for r in held(ROWS, -7.0)] == [-9.0]
    assert [r["logprob"] for r in let_end(ROWS, -7.0)] == []
    assert [r["logprob"] for r in let_end(ROWS, -10.0)] == [-8.0]


def test_the_sweep_counts_both_ways_to_be_wrong_and_includes_the_configured_threshold():
    sweep = {row["threshold"]: row for row in summarise(ROWS, -8.5)["sweep"]}
    assert -8.5 in sweep and -7.0 in sweep
    assert (sweep[-8.5]["finished_held"], sweep[-8.5]["fragments_let_end"]) == (1, 1)
    assert (sweep[-3.0]["finished_held"], sweep[-3.0]["fragments_let_end"]) == (1, 0)


def test_a_fragment_the_words_hold_is_not_the_thresholds_to_get_wrong():
    assert summarise(ROWS, -7.0)["unfinished_count"] == 2
    assert "| unfinished | unfinished | -1.0 | held by the words |" in render(
        ROWS, summarise(ROWS, -7.0))


def test_the_report_marks_what_the_configured_threshold_gets_wrong():
    text = render(ROWS, summarise(ROWS, -7.0))
    assert "| finished | finished | -9.0 | holds (wrong) |" in text
    assert "| -7.0 (configured) | 1 | 0 |" in text


def test_the_shipped_phrases_have_both_labels():
    phrases = load_phrases(DEFAULT_PHRASES)
    assert len(phrases["finished"]) >= 20 and len(phrases["unfinished"]) >= 20


def test_a_phrase_file_without_fragments_is_refused(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("finished: [Hello.]\n")
    with pytest.raises(ValueError, match="unfinished"):
        load_phrases(path)


def test_the_target_scores_the_fragment_below_the_finished_question(models):
    rows = asyncio.run(_score_all(models.worker, models.llm.target.tokenizer, {
        "finished": ["What is the capital of France?"], "unfinished": ["What is the capital?"]}))
    finished, fragment = rows
    assert not finished["held_by_words"] and not fragment["held_by_words"]
    assert (finished["words"], fragment["words"]) == (
        "what is the capital of france", "what is the capital")
    assert fragment["logprob"] < finished["logprob"]
