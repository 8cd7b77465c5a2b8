"""Constrained decoding on tiny random models: the grammar state, the grammar proposer, and the
engine's output under a grammar (schema-valid whatever the seed, temperature and proposer)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_engine.config import EngineConfig, GrammarSpec, SamplingConfig, SpeculationConfig
from llm_engine.engine import SpeculativeEngine
from llm_engine.grammar import GrammarCache, parse_tool_call, tool_functions
from llm_engine.proposers import ProposeContext, make_proposer
from llm_engine.proposers.base import DraftBuilder
from llm_engine.sampling import make_generator
from llm_engine.stats import RequestStats
from tests.llm_engine.requests import run

EOS = 2
ORDER = {"type": "function", "function": {"name": "lookup_order", "parameters": {
    "type": "object", "properties": {"order_id": {"type": "string", "pattern": "^[A-Z0-9]{1,6}$"}},
    "required": ["order_id"]}}}
BOOK = {"name": "book_slot", "parameters": {
    "type": "object",
    "properties": {"day": {"enum": ["monday", "tuesday", "friday"]},
                   "hour": {"type": "integer", "minimum": 8, "maximum": 17}},
    "required": ["day", "hour"]}}
END_CALL = {"name": "end_call"}
TOOLS = GrammarSpec(kind="tools", tools=[ORDER, BOOK, END_CALL], tool_choice="required")
ONE_TOOL = GrammarSpec(kind="tools", tools=[ORDER])
SCHEMA = {"type": "object",
          "properties": {"day": {"enum": ["monday", "tuesday"]}, "ok": {"type": "boolean"},
                         "note": {"type": "string", "pattern": "^[a-z ]{0,5}$"}},
          "required": ["day", "ok", "note"]}
JSON = GrammarSpec(kind="json_schema", json_schema=SCHEMA)
# Strings are bounded with a pattern: xgrammar 0.2.9 lets a maxLength string hold raw control
# characters, which is not JSON.
METHODS = ["off", "ngram", "grammar", "grammar+ngram", "draft", "grammar+draft"]


@pytest.fixture(scope="module")
def cache(tokenizer, target):
    return GrammarCache(tokenizer, target.config.vocab_size, {EOS})


@pytest.fixture(scope="module")
def engines(target, draft, tokenizer):
    return {method: SpeculativeEngine(
        target, tokenizer, EngineConfig(speculation=SpeculationConfig(method=method)),
        draft_model=draft) for method in METHODS}


def decode(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode([t for t in tokens if t != EOS])


def assert_valid(spec: GrammarSpec, text: str, finish: str) -> None:
    """A finished output is one schema-valid value, free text, or free text and one schema-valid
    call; an output cut by the budget is checked by the caller as a grammar prefix."""
    if finish != "eos":
        return
    if spec.kind == "json_schema":
        jsonschema.validate(json.loads(text), spec.json_schema)
        return
    if spec.tool_choice == "auto" and "<tool_call>" not in text:
        return  # free text: no call
    call = parse_tool_call(text)
    assert call is not None and text.endswith("</tool_call>"), text
    functions = {f["name"]: f for f in tool_functions(spec)}
    params = functions[call["name"]].get("parameters") or {"type": "object", "properties": {}}
    jsonschema.validate(call["arguments"], {**params, "additionalProperties": False})


# -- the spec and the method names ----------------------------------------------------------------


def test_a_spec_without_its_schema_or_tool_names_is_refused():
    with pytest.raises(ValueError, match="json_schema"):
        GrammarSpec(kind="json_schema")
    with pytest.raises(ValueError, match="at least one tool"):
        GrammarSpec(kind="tools")
    with pytest.raises(ValueError, match="without a name"):
        GrammarSpec(kind="tools", tools=[{"parameters": {}}])


def test_grammar_combines_with_another_method_but_not_the_other_way_round():
    assert SpeculationConfig(method="grammar+ngram").method == "grammar+ngram"
    with pytest.raises(ValueError, match="does not combine"):
        SpeculationConfig(method="ngram+grammar")
    with pytest.raises(ValueError, match="unknown"):
        SpeculationConfig(method="grammar+medusa")


def test_compiled_grammars_are_cached_per_spec(cache):
    assert cache.compile(TOOLS) is cache.compile(GrammarSpec(**vars(TOOLS)))
    assert cache.compile(TOOLS) is not cache.compile(ONE_TOOL)


# -- the grammar state -------------------------------------------------------------------------


def test_the_only_tool_name_and_the_arguments_key_are_forced(cache, tokenizer):
    state = cache.new_state(ONE_TOOL, 32)
    for token in tokenizer.encode('Sure. <tool_call>{"name": "'):
        assert state.push(token)
    forced = state.forced(30)
    assert decode(tokenizer, forced).startswith('lookup_order", "arguments": {"order_id": ')
    assert state.frontier[-len(forced):] == forced  # pushed onto the frontier


def test_the_grammar_proposer_drafts_the_forced_tokens_and_otherwise_its_inner(cache, tokenizer):
    proposer = make_proposer("grammar+ngram", SpeculationConfig())
    prompt = tokenizer.encode("lookup_order lookup_order lookup")
    proposer.begin(prompt)
    free = cache.new_state(ONE_TOOL, 8)
    draft = proposer.propose(ProposeContext(prompt, 4, SamplingConfig(), make_generator(0), free))
    assert draft.forced == 0 and draft.tokens  # free text: the n-gram lookup drafts
    required = cache.new_state(GrammarSpec(kind="tools", tools=[ORDER], tool_choice="required"), 8)
    draft = proposer.propose(
        ProposeContext(prompt, 4, SamplingConfig(), make_generator(0), required))
    assert draft.forced == len(draft.tokens) == 4
    assert decode(tokenizer, draft.tokens) == decode(tokenizer, required.frontier)
    assert "<tool_call>".startswith(decode(tokenizer, draft.tokens)[:11])


def test_eos_is_allowed_only_where_the_value_is_complete(cache, tokenizer):
    state = cache.new_state(JSON, 8)
    assert not state.allowed()[EOS]
    for token in tokenizer.encode('{"day": "monday", "ok": true, "note": ""}'):
        assert state.push(token)
    assert state.allowed().nonzero().flatten().tolist() == [EOS]
    assert state.forced(4) == [EOS] and state.done


def test_commit_after_a_rejection_equals_a_matcher_fed_the_committed_tokens(cache, tokenizer):
    text = tokenizer.encode('{"day": "tuesday", "ok": false, "note": "hi"}')
    speculative, reference = cache.new_state(JSON, 16), cache.new_state(JSON, 16)
    for token in text[:3]:
        speculative.commit(0, [token])
        reference.commit(0, [token])
    assert speculative.constrain(text[3:9]) == 6
    masks = speculative.masks()  # [7, vocab]: one row per verified position
    assert masks.shape == (7, len(tokenizer))
    recovered = int(masks[2].nonzero()[-1])  # any allowed token but the draft's
    speculative.commit(2, [*text[3:5], recovered])
    for token in [*text[3:5], recovered]:
        reference.commit(0, [token])
    assert torch.equal(speculative.masks(), reference.masks())
    assert speculative.forced(8) == reference.forced(8)


def test_a_constrained_draft_is_sampled_from_the_masked_q(cache, tokenizer, draft):
    state = cache.new_state(JSON, 8)
    builder = DraftBuilder(SamplingConfig(temperature=5.0), make_generator(0), state)
    allowed = [state.allowed()]
    for _ in range(3):
        builder.choose(torch.randn(1, len(tokenizer)))
        allowed.append(state.allowed())
    proposal = builder.build()
    assert proposal.q is not None and proposal.tokens == state.frontier
    for row, mask in zip(proposal.q, allowed, strict=False):
        assert row[~mask].sum() == 0 and torch.isclose(row.sum(), torch.tensor(1.0))


# -- the engine under a grammar -----------------------------------------------------------------


@pytest.mark.parametrize("spec", [TOOLS, JSON, ONE_TOOL], ids=["tools", "json", "free-or-call"])
def test_greedy_constrained_output_is_identical_across_proposers(engines, tokenizer, spec):
    for prompt in ["Call a tool.", "book me on friday", '{"day": "monday"}']:
        ids = tokenizer.encode(prompt)
        outputs = {m: run(e, ids, SamplingConfig(max_new_tokens=48, grammar=spec))[0]
                   for m, e in engines.items()}
        assert all(out == outputs["off"] for out in outputs.values()), outputs
        finish = run(engines["off"], ids, SamplingConfig(max_new_tokens=48, grammar=spec))[1]
        assert_valid(spec, decode(tokenizer, outputs["off"]), finish.finish_reason)


def test_grammar_drafts_are_counted_and_survive_serialisation(engines, tokenizer):
    tokens, state = run(engines["grammar"], tokenizer.encode("hi"),
                        SamplingConfig(max_new_tokens=128, grammar=TOOLS))
    assert state.finish_reason == "eos" and tokens[-1] == EOS
    assert state.stats.grammar_drafted > 0
    assert state.stats.grammar_drafted <= state.stats.drafted
    again = RequestStats.from_dict(json.loads(json.dumps(state.stats.to_dict())))
    assert again.grammar_drafted == state.stats.grammar_drafted


@pytest.mark.parametrize("budget", [1, 3, 8])
def test_a_budget_that_runs_out_mid_call_ends_with_length_and_no_call(engines, tokenizer, budget):
    tokens, state = run(engines["grammar+ngram"], tokenizer.encode("hi"),
                        SamplingConfig(max_new_tokens=budget, grammar=TOOLS))
    assert state.finish_reason == "length" and len(tokens) == budget
    assert parse_tool_call(decode(tokenizer, tokens)) is None
    assert '<tool_call>{"name": "'.startswith(decode(tokenizer, tokens)[:20])


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**31),
    temperature=st.sampled_from([0.0, 0.7, 1.0, 3.0, 20.0]),
    spec=st.sampled_from([TOOLS, JSON, ONE_TOOL]),
    method=st.sampled_from(METHODS),
    top_k=st.sampled_from([0, 5]),
    budget=st.sampled_from([6, 24, 64]),
)
def test_constrained_output_is_always_schema_valid(
        engines, cache, tokenizer, seed, temperature, spec, method, top_k, budget):
    prompt = tokenizer.encode(["Call a tool.", "hi", "lookup"][seed % 3])
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, seed=seed,
                              max_new_tokens=budget, grammar=spec)
    tokens, state = run(engines[method], prompt, sampling)
    assert state.finish_reason in {"eos", "length"}
    assert (state.finish_reason == "eos") == (tokens[-1:] == [EOS])
    assert EOS not in tokens[:-1]
    cache.new_state(spec, 8).commit(0, tokens)  # raises unless a fresh matcher accepts them all
    assert_valid(spec, decode(tokenizer, tokens), state.finish_reason)


@pytest.mark.parametrize("seed", range(6))
def test_tool_choice_none_answers_in_text_without_a_call_or_the_excluded(
        engines, tokenizer, seed):
    spec = GrammarSpec(kind="tools", tools=[ORDER], tool_choice="none", exclude=["{", "<"])
    sampling = SamplingConfig(temperature=3.0, seed=seed, max_new_tokens=48, grammar=spec)
    tokens, _ = run(engines["grammar+ngram"], tokenizer.encode("lookup"), sampling)
    text = decode(tokenizer, tokens)
    assert text and not set(text) & {"{", "<"}


@pytest.mark.parametrize("seed", range(6))
def test_tool_choice_auto_with_an_exclusion_keeps_it_out_of_the_words_but_not_the_call(
        engines, tokenizer, seed):
    spec = GrammarSpec(kind="tools", tools=[ORDER], tool_choice="auto", exclude=["{"])
    sampling = SamplingConfig(temperature=3.0, seed=seed, max_new_tokens=64, grammar=spec)
    tokens, state = run(engines["grammar+ngram"], tokenizer.encode("lookup"), sampling)
    text = decode(tokenizer, tokens)
    words, _, call = text.partition("<tool_call>")
    assert "{" not in words
    if call and state.finish_reason == "eos":
        assert parse_tool_call(text)["name"] == ORDER["function"]["name"]
