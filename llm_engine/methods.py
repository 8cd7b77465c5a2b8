"""The speculation methods by name: what each drafts with and how they compose.

Standard library only, so a config, the CLI's help and the benches check a method without loading
torch. Each proposer class (`llm_engine.proposers`) registers against its entry here, and
tests/llm_engine/test_methods.py checks that the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    # The engine setting that names the model it drafts with ("draft": engine.draft, "eagle":
    # engine.eagle); None for a method without a model.
    model_setting: str | None = None
    # Sampled drafts are drawn from the request's generator and carry q (verified by rejection
    # sampling on that generator); otherwise drafts are deterministic (q is None).
    samples_drafts: bool = False
    # It reads the target's last hidden states after every target forward (EAGLE).
    uses_target_hidden: bool = False
    # It combines with another method per step: "<this>+<other>" drafts with <other> where this
    # one has nothing.
    combines: bool = False


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("off", "plain decoding through the same code path, for A/B runs"),
    Method("ngram", "prompt lookup over the prompt and the reply so far"),
    Method("draft", "a smaller causal LM of the same tokenizer (engine.draft)",
           model_setting="draft", samples_drafts=True),
    Method("eagle", "an EAGLE head over the target's own hidden states (engine.eagle)",
           model_setting="eagle", samples_drafts=True, uses_target_hidden=True),
    Method("grammar", "the tokens a constrained request's grammar forces; grammar+<one> drafts "
           "with <one> elsewhere", combines=True),
)}


def names() -> list[str]:
    return sorted(METHODS)


def check(name: str, what: str = "speculation method") -> None:
    """Refuse a name that is neither a method nor "<combining>+<method>"."""
    outer, _, inner = name.partition("+")
    if outer not in METHODS:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(names())} "
                         "(or grammar+<one>)")
    if inner:
        if not METHODS[outer].combines:
            raise ValueError(f"{what} {outer!r} does not combine with another: {name!r}")
        check(inner, what)


def choices() -> list[str]:
    """Every valid name: the methods, then each combination of one with another."""
    combined = [f"{outer}+{inner}" for outer in names() if METHODS[outer].combines
                for inner in names() if not METHODS[inner].combines]
    return names() + combined


def help_text() -> str:
    plain = ", ".join(names())
    return f"{plain}, or " + " or ".join(f"{m}+<one>" for m in names() if METHODS[m].combines)


def innermost(name: str) -> Method:
    """The method that drafts with a model where a combined one ("grammar+draft") has nothing."""
    return METHODS[name.rpartition("+")[2]]


def model_setting(name: str) -> str | None:
    """The engine setting naming the model a method drafts with: a combined method's innermost."""
    return innermost(name).model_setting


def model_settings() -> dict[str, str]:
    """Methods that draft with a model, and the engine setting naming it."""
    return {m.name: m.model_setting for m in METHODS.values() if m.model_setting is not None}
