import pytest

from audio.text import ClauseSplitter, split_clauses


def stream(deltas, min_chars=6):
    """Feed deltas one by one; returns [(index of the delta that released it, clause)], rest."""
    s = ClauseSplitter(min_chars)
    out = [(i, c) for i, d in enumerate(deltas) for c in s.push(d)]
    return out, s.flush()


def test_clause_is_released_as_soon_as_the_space_after_it_arrives():
    out, rest = stream(["The capital", " of France", " is Paris", ".", " It", " is big."])
    assert out == [(4, "The capital of France is Paris.")]
    assert rest == "It is big."


@pytest.mark.parametrize("mark", [",", ";", ":", "!", "?", "."])
def test_each_clause_mark_ends_a_clause(mark):
    assert split_clauses(f"Well, first of all{mark} we go home") == [
        f"Well, first of all{mark}", "we go home"
    ]


def test_short_clauses_wait_for_the_next_one():
    assert split_clauses("Hi, how are you? 1, 2, go!") == ["Hi, how are you?", "1, 2, go!"]


def test_decimals_and_thousands_are_not_split():
    assert split_clauses("It costs 3.5 dollars or 1,000 cents in total today.") == [
        "It costs 3.5 dollars or 1,000 cents in total today."
    ]


def test_decimal_split_across_deltas_is_not_split():
    out, rest = stream(["It is about 3", ".", "5 meters long"])
    assert out == [] and rest == "It is about 3.5 meters long"


def test_abbreviations_and_initials_are_not_split():
    text = "Mr. Smith met Dr. Jones and J. K. Rowling, e.g. at the U.S. embassy. Then left."
    assert split_clauses(text) == [
        "Mr. Smith met Dr. Jones and J. K. Rowling,",
        "e.g. at the U.S. embassy.",
        "Then left.",
    ]


def test_spaced_dash_and_newline_end_a_clause_but_a_hyphen_does_not():
    text = "A well-known place - the Louvre\nIt is a museum — a big one"
    assert split_clauses(text) == [
        "A well-known place -", "the Louvre", "It is a museum —", "a big one"
    ]


def test_closing_quotes_and_repeated_marks_stay_with_their_clause():
    assert split_clauses('He said "stop it!" and then?! he left...') == [
        'He said "stop it!"', "and then?!", "he left..."
    ]


def test_flush_returns_a_short_tail_and_resets():
    s = ClauseSplitter()
    assert s.push("Okay, ") == []
    assert s.flush() == "Okay,"
    assert s.flush() is None
    assert s.push("Next one here, please ") == ["Next one here,"]


def test_reset_drops_pending_text():
    s = ClauseSplitter()
    s.push("Half a clause")
    s.reset()
    assert s.pending == "" and s.flush() is None


def test_first_phrase_ends_before_a_phrase_opener_after_enough_words():
    splitter = ClauseSplitter(min_chars=6, first_phrase_words=3)
    out = []
    for token in ["I", " can", " help", " you", " with", " that", " order", ". ", "And", " then"]:
        out += splitter.push(token)
    assert out == ["I can help you", "with that order."]  # only the first phrase is cut early


def test_first_phrase_waits_for_enough_words_and_a_whole_opener():
    splitter = ClauseSplitter(min_chars=6, first_phrase_words=3)
    assert splitter.push("It is in") == []  # "in" after two words: too early to break
    assert splitter.push(" the box with") == []  # "with" may still be the start of "without"
    assert splitter.push(" a") == ["It is in the box"]
