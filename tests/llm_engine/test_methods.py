"""The method list (`llm_engine.methods`): it agrees with the proposer classes, and reading it (or
a config) loads no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llm_engine import methods
from llm_engine.proposers import registered


def test_every_method_has_a_proposer_class_and_every_class_a_method():
    assert set(registered()) == set(methods.METHODS)


@pytest.mark.parametrize("name", sorted(methods.METHODS))
def test_a_proposer_class_says_what_its_method_entry_says(name):
    entry, cls = methods.METHODS[name], registered()[name]
    for flag in ("model_setting", "samples_drafts", "uses_target_hidden", "combines"):
        declared = getattr(cls, flag)
        if isinstance(declared, property):  # a combining proposer answers for the one it wraps
            continue
        assert declared == getattr(entry, flag), f"{cls.__name__}.{flag}"


def test_a_combined_method_takes_its_model_from_the_one_it_wraps():
    assert methods.model_setting("grammar+draft") == "draft"
    assert methods.model_setting("grammar+ngram") is None


@pytest.mark.parametrize("name, message", [("medusa", "known: draft, eagle"),
                                           ("ngram+draft", "does not combine"),
                                           ("grammar+medusa", "unknown")])
def test_a_bad_method_name_is_refused_with_the_reason(name, message):
    with pytest.raises(ValueError, match=message):
        methods.check(name)


def test_the_choices_are_every_valid_name_and_nothing_else():
    for name in methods.choices():
        methods.check(name)
    assert "grammar+eagle" in methods.choices() and "ngram+off" not in methods.choices()


def test_loading_the_config_imports_neither_torch_nor_transformers():
    code = ("import sys\nfrom voiceagent.config import load_config\n"
            "load_config(None, ['engine.speculation.method=grammar+draft'])\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]
