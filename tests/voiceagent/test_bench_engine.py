"""`voiceagent bench engine`: the pure aggregation on hand-made numbers, and the harness end to end
on tiny random models (no model loading, no downloads)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import yaml

from llm_engine.config import EngineConfig, GrammarSpec, SamplingConfig, SpeculationConfig
from llm_engine.engine import SpeculativeEngine
from llm_engine.grammar import GrammarCache
from tests.llm_engine.tiny_models import make_model, make_tokenizer
from voiceagent.bench.engine import (
    BenchSettings,
    build_report,
    check_tool_call,
    report_header,
    run_bench,
    settings_from_args,
    write_results,
)
from voiceagent.bench.results import (
    RunRecord,
    first_difference,
    geomean,
    is_baseline,
    lossless_check,
    paired_geomean,
    render_markdown,
    summarise,
)
from voiceagent.cli import main
from voiceagent.config import REPO_ROOT, load_config
from voiceagent.prompt_sets import PromptSet, load_prompt_set


def record(mode="off", times=(100.0, 150.0, 200.0), tokens=None, prompt=0, segment="s",
           temperature=0.0, **extra) -> RunRecord:
    times = list(times)
    return RunRecord(
        mode=mode, engine=not is_baseline(mode), segment=segment, prompt_index=prompt,
        repeat=0, temperature=temperature, prompt_tokens=5,
        token_ids=list(tokens) if tokens is not None else list(range(len(times))),
        token_times_ms=times, **extra,
    )


# -- pure aggregation ---------------------------------------------------------------------------


def test_geomean_of_reciprocal_ratios_is_one():
    assert geomean([2.0, 0.5]) == pytest.approx(1.0)
    assert geomean([1.0, 4.0]) == pytest.approx(2.0)
    assert geomean([]) is None
    with pytest.raises(ValueError):
        geomean([1.0, 0.0])


def test_run_rates_split_first_token_from_decode():
    r = record(times=[100.0, 150.0, 150.0, 200.0])  # the middle two came in one step
    assert r.ttft_ms == 100.0
    assert r.itl_ms == [50.0, 0.0, 50.0]
    assert r.decode_tok_s == pytest.approx(3 * 1000 / 100)  # 3 tokens after the first in 100 ms
    assert r.e2e_tok_s == pytest.approx(4 * 1000 / 200)
    assert record(times=[100.0]).decode_tok_s is None


def test_ratios_are_paired_per_prompt_then_geometric_mean():
    records = [
        record("off", [0.0, 100.0], prompt=0),  # 10 tok/s
        record("ngram", [0.0, 50.0], prompt=0),  # 20 tok/s: 2x
        record("off", [0.0, 50.0], prompt=1),  # 20 tok/s
        record("ngram", [0.0, 100.0], prompt=1),  # 10 tok/s: 0.5x
        record("ngram", [0.0, 10.0], prompt=2),  # no `off` run to pair with: ignored
    ]
    assert paired_geomean(records, "ngram", "off") == pytest.approx(1.0)
    (_, cell) = summarise(records, ["off", "ngram"])["cells"]
    assert cell["ratio_vs_off_range"] == pytest.approx([0.5, 2.0])


def test_first_difference_counts_a_length_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 9, 3], [1, 2, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_lossless_check_compares_greedy_runs_with_off_only():
    records = [
        record("off", tokens=[5, 6, 7]),
        record("ngram", tokens=[5, 6, 7]),
        record("draft", tokens=[5, 6, 8]),
        record("hf_plain", tokens=[5, 9, 9]),
        record("off", tokens=[1, 2, 3], temperature=0.8),
        record("ngram", tokens=[4, 4, 4], temperature=0.8),  # sampled: not compared
    ]
    result = lossless_check(records)
    assert result["ngram"] == {"checked": True, "compared": 1, "mismatches": 0, "first_diff": [],
                               "why": None}
    assert result["draft"]["mismatches"] == 1 and result["draft"]["first_diff"][0]["at"] == 2
    assert result["hf_plain"]["checked"] is False and result["hf_plain"]["mismatches"] == 1


def test_cell_pools_acceptance_steps_and_step_times():
    runs = [
        record("ngram", [10.0, 20.0, 20.0, 30.0], forwards=3, steps=2, speculative_steps=2,
               accepted=1,
               drafted_by_pos=[2, 1], accepted_by_pos=[1, 0], draft_ms=1.0, verify_ms=19.0),
        record("ngram", [10.0, 20.0, 30.0], forwards=3, steps=2, speculative_steps=1, accepted=0,
               drafted_by_pos=[1], accepted_by_pos=[0], draft_ms=1.0, verify_ms=19.0,
               gated_off=True),
    ]
    (cell,) = summarise(runs, ["ngram"])["cells"]
    assert cell["tokens_per_forward"] == pytest.approx(7 / 6)
    assert cell["accepted_per_step"] == pytest.approx(1 / 3)
    assert cell["acceptance_by_pos"] == pytest.approx([1 / 3, 0.0])
    assert cell["draft_ms_per_step"] == pytest.approx(0.5)
    assert cell["verify_ms_per_step"] == pytest.approx(9.5)
    assert cell["gated_off_runs"] == 1
    assert cell["decode_tok_s"] == pytest.approx(5 * 1000 / 40)


def test_ratio_b_picks_the_best_speculative_mode_per_segment():
    records = [
        record("off", [0.0, 100.0], segment="chat"),
        record("ngram", [0.0, 125.0], segment="chat"),  # 0.8x
        record("draft", [0.0, 80.0], segment="chat"),  # 1.25x
        record("off", [0.0, 100.0], segment="echo"),
        record("ngram", [0.0, 50.0], segment="echo"),  # 2x
        record("draft", [0.0, 100.0], segment="echo"),  # 1x
    ]
    b = summarise(records, ["off", "ngram", "draft"])["ratios"]["b_best_speculative_vs_off_t0"]
    assert b["chat"]["best_mode"] == "draft" and b["chat"]["best"] == pytest.approx(1.25)
    assert b["echo"]["best_mode"] == "ngram" and b["echo"]["best"] == pytest.approx(2.0)


def test_markdown_has_one_table_per_temperature_and_the_ratios():
    records = [
        record("off", [0.0, 100.0]), record("hf_plain", [0.0, 200.0]),
        record("off", [0.0, 100.0], temperature=0.8),
        record("hf_plain", [0.0, 100.0], temperature=0.8),
    ]
    text = render_markdown(summarise(records, ["off", "hf_plain"]), ["- header line"])
    assert "## Temperature 0\n" in text and "## Temperature 0.8\n" in text
    assert "| s | hf_plain | 2 | 5.0 |" in text
    assert "(a) engine off ÷ HF generate() plain, T=0: s 2.00, all 2.00" in text
    assert "| hf_plain | informative | 1 | 0 | – |" in text


def test_the_anchor_is_a_baseline_compared_with_off_and_never_the_best_mode():
    records = [
        record("off", [0.0, 100.0]),
        record("ngram", [0.0, 50.0], tokens=[0, 1]),
        record("anchor", [0.0, 25.0], tokens=[0, 2]),
    ]
    summary = summarise(records, ["off", "ngram", "anchor"])
    assert summary["ratios"]["e_anchor_vs_off"]["0.0"]["all"] == pytest.approx(4.0)
    assert summary["ratios"]["b_best_speculative_vs_off_t0"]["all"]["best_mode"] == "ngram"
    assert summary["ratios"]["d_slowest_vs_own_off"]["0.0"]["mode"] == "ngram"
    assert not summary["lossless"]["anchor"]["checked"]
    text = render_markdown(summary, [])
    assert "(e) anchor server ÷ engine off, T=0: s 4.00, all 4.00" in text
    assert "| anchor | informative (its streamed text, re-tokenised) | 1 | 1 |" in text


# -- settings and the command line --------------------------------------------------------------


def bench_args(**kw):
    base = dict(methods=None, temperatures=None, max_new_tokens=None, repeats=1, segments=None,
                seed=0, hf_lookup_tokens=10, no_hf=False, quick=False, formats=None,
                quality=False, anchor_url=None, anchor_model=None)
    return SimpleNamespace(**{**base, **kw})


def test_quick_fills_only_what_the_flags_leave_unset():
    cfg = load_config()
    s = settings_from_args(bench_args(quick=True), cfg)
    assert (s.temperatures, s.max_new_tokens, s.prompts_per_segment) == ([0.0], 32, 1)
    s = settings_from_args(bench_args(quick=True, max_new_tokens=8, methods="ngram"), cfg)
    assert s.max_new_tokens == 8 and s.modes == ["off", "ngram"]  # off: always the reference


def test_draft_mode_without_a_draft_model_is_refused_before_loading(capsys):
    assert main(["bench", "engine", "--methods", "off,draft", "--set", "engine.draft=null"]) == 2
    assert "needs a draft model" in capsys.readouterr().err


def test_the_shipped_prompt_set_keeps_version_1s_segments_and_adds_tool_calls_on_request():
    prompts = load_prompt_set()
    v1 = load_prompt_set(REPO_ROOT / "configs" / "prompts" / "engine_bench_v1.yaml")
    assert prompts.version == 2
    assert list(prompts.segments) == [*v1.segments, "tool_call"]
    assert all(prompts.segments[name] == v1.segments[name] for name in v1.segments)
    assert prompts.on_request == ["tool_call"] and list(prompts.tools) == ["tool_call"]


# -- the harness end to end on tiny models ------------------------------------------------------


@pytest.fixture
def one_thread():
    # Tiny models gain nothing from a second thread, and on a shared 2-core machine an OpenMP
    # barrier waiting on a busy core made each forward ~100x slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_harness_runs_every_mode_and_segment_and_greedy_modes_match_off(tmp_path, one_thread):
    tokenizer = make_tokenizer()
    target = make_model(len(tokenizer), seed=0)
    draft = make_model(len(tokenizer), seed=1, layers=1, hidden=32)
    config = EngineConfig(
        speculation=SpeculationConfig(method="ngram"), sampling=SamplingConfig(max_new_tokens=12)
    )
    engine = SpeculativeEngine(target, tokenizer, config, draft_model=draft)
    prompt_set = PromptSet(
        version=0, system="Be brief.", path="inline", sha256="-",
        segments={
            "chat": ["Hello, how can I help you today?", "Thank you for calling."],
            "echo": ["The moon orbits the earth every 27 days. The moon orbits the earth"],
        },
    )
    settings = BenchSettings(modes=["off", "ngram", "draft"], temperatures=[0.0, 0.8],
                             max_new_tokens=12, warmup_tokens=2)
    lines = []
    records, modes = run_bench(engine, tokenizer, prompt_set, settings, hf_model=target,
                               hf_draft=draft, progress=lines.append)
    assert modes == ["off", "ngram", "draft", "hf_plain", "hf_prompt_lookup", "hf_assisted"]
    assert len(records) == len(modes) * 3 * 2
    assert len(lines) == 1 + 3 * 2  # warm-up, then one line per prompt and temperature

    report = build_report(records, modes, settings, prompt_set, engine)
    json_path, md_path = write_results(
        report, render_markdown(report["summary"], report_header(report)), tmp_path
    )
    data = json.loads(json_path.read_text())
    cells = {(c["temperature"], c["segment"], c["mode"]) for c in data["summary"]["cells"]}
    assert cells == {(t, s, m) for t in (0.0, 0.8) for s in ("chat", "echo") for m in modes}
    for mode in ("ngram", "draft"):
        assert data["summary"]["lossless"][mode]["compared"] == 3
        assert data["summary"]["lossless"][mode]["mismatches"] == 0
    assert data["machine"]["torch_threads"] >= 1
    assert "| echo | hf_assisted |" in md_path.read_text()


def test_a_draft_training_prompt_set_is_benchmarked_on_its_heldout_items_only():
    path = REPO_ROOT / "configs" / "prompts" / "distill_v1.yaml"
    categories = yaml.safe_load(path.read_text())["categories"]
    prompts = load_prompt_set(path).segments
    for name, items in categories.items():
        heldout = [i for i in items if isinstance(i, dict) and i.get("heldout")]
        assert len(prompts[name]) == len(heldout)
    assert all(isinstance(p, list) for p in prompts["multi_turn"])  # whole conversations


def test_every_mode_runs_in_each_other_format_against_that_formats_off(tmp_path):
    from llm_engine.formats import convert
    from voiceagent.bench.formats import format_section, render_formats

    tokenizer = make_tokenizer()
    target = make_model(len(tokenizer), seed=0)
    config = EngineConfig(speculation=SpeculationConfig(method="ngram"),
                          sampling=SamplingConfig(max_new_tokens=10))
    engine = SpeculativeEngine(target, tokenizer, config)
    other = SpeculativeEngine(convert(target, "bfloat16"), tokenizer, config)
    prompt_set = PromptSet(version=0, system="", path="inline", sha256="-",
                           segments={"chat": ["Hello, how can I help you today?"]})
    settings = BenchSettings(modes=["off", "ngram"], temperatures=[0.0], max_new_tokens=10,
                             warmup_tokens=2, hf=False)
    records, modes = run_bench(engine, tokenizer, prompt_set, settings,
                               other_formats={"bfloat16": other})
    assert modes == ["off", "ngram", "off@bfloat16", "ngram@bfloat16"]
    section = format_section({"float32": engine.cost_model, "bfloat16": other.cost_model},
                             "float32", {"float32": engine.runner, "bfloat16": other.runner},
                             [], {})
    report = build_report(records, modes, settings, prompt_set, engine, formats=section)
    summary = report["summary"]
    cells = {c["mode"]: c for c in summary["cells"]}
    rate = {r.mode: r.decode_tok_s for r in records}
    assert cells["off@bfloat16"]["ratio_vs_off"] == 1.0  # a reference, like off
    assert cells["ngram@bfloat16"]["ratio_vs_off"] == pytest.approx(
        rate["ngram@bfloat16"] / rate["off@bfloat16"])
    lossless = summary["lossless"]
    assert lossless["ngram"]["checked"] and not lossless["ngram@bfloat16"]["checked"]
    assert "off@bfloat16" not in lossless
    text = render_markdown(summary, report_header(report), render_formats(section))
    assert "informative (rounding by row count)" in text
    assert "| rows | float32 ms | × 1 row | bfloat16 ms | × 1 row |" in text
    assert "(d) slowest mode ÷ the off of its format" in text


def test_unknown_formats_are_refused_before_loading():
    with pytest.raises(ValueError, match="unknown format"):
        settings_from_args(bench_args(formats="float32,int3"), load_config())


def test_a_cpu_bench_runs_fp32_and_bf16_side_by_side_by_default():
    s = settings_from_args(bench_args(), load_config(None, ["engine.device=cpu"]))
    assert s.formats == ["float32", "bfloat16", "int8", "q4"]


# -- the tool-call segment ----------------------------------------------------------------------

ORDER = {"type": "function", "function": {"name": "lookup_order", "parameters": {
    "type": "object", "properties": {"order_id": {"type": "string", "pattern": "^[0-9]{5}$"}},
    "required": ["order_id"], "additionalProperties": False}}}
BOOK = {"type": "function", "function": {"name": "book_slot", "parameters": {
    "type": "object",
    "properties": {"day": {"enum": ["monday", "friday"]},
                   "hour": {"type": "integer", "minimum": 8, "maximum": 18}},
    "required": ["day", "hour"], "additionalProperties": False}}}
TOOLS = GrammarSpec(kind="tools", tools=[ORDER, BOOK], tool_choice="required")


@pytest.mark.parametrize(("text", "valid"), [
    ('<tool_call>{"name": "book_slot", "arguments": {"day": "friday", "hour": 15}}</tool_call>',
     True),
    ('<tool_call>{"name": "lookup_order", "arguments": {"order_id": "48213"}}</tool_call>', True),
    ('<tool_call>{"name": "cancel_order", "arguments": {"order_id": "48213"}}</tool_call>',
     False),  # not one of the tools
    ('<tool_call>{"name": "book_slot", "arguments": {"day": "friday", "hour": 19}}</tool_call>',
     False),  # out of bounds
    ('<tool_call>{"name": "book_slot", "arguments": {"day": "friday"}}</tool_call>', False),
    ('<tool_call>{"name": "lookup_order", "arguments": {"order_id": "48213", "x": 1}}</tool_call>',
     False),  # a property the schema does not allow
    ('<tool_call>{"name": "lookup_order", "arguments": {"order_id": "482', False),  # cut off
    ("Your order is on its way.", False),
])
def test_a_call_is_valid_only_with_a_listed_name_and_arguments_under_its_schema(text, valid):
    assert check_tool_call(text, TOOLS)[1] is valid


def test_every_shipped_tool_call_prompt_has_tools_that_compile_into_a_grammar():
    prompts = load_prompt_set()
    tokenizer = make_tokenizer()
    cache = GrammarCache(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    assert 8 <= len(prompts.segments["tool_call"]) <= 12
    for tools in prompts.tools["tool_call"]:
        assert 2 <= len(tools) <= 4
        cache.compile(GrammarSpec(kind="tools", tools=tools, tool_choice="required"))


def test_modes_are_checked_before_loading_combined_ones_included(capsys):
    cfg = load_config()
    s = settings_from_args(bench_args(methods="grammar,grammar+ngram"), cfg)
    assert s.modes == ["off", "grammar", "grammar+ngram"]
    assert main(["bench", "engine", "--methods", "off,grammar+bogus"]) == 2
    assert "mode 'grammar+bogus': unknown method 'bogus'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs a draft model"):
        settings_from_args(bench_args(methods="grammar+draft"),
                           load_config(None, ["engine.draft=null"]))


def test_tool_call_prompts_run_under_the_grammar_and_every_call_is_schema_valid(
        tmp_path, one_thread):
    tokenizer = make_tokenizer()
    target = make_model(len(tokenizer), seed=0)
    config = EngineConfig(speculation=SpeculationConfig(method="ngram"))
    engine = SpeculativeEngine(target, tokenizer, config)
    prompt_set = PromptSet(
        version=0, system="Be brief.", path="inline", sha256="-",
        segments={"chat": ["Hello, how can I help you today?"],
                  "tool_call": ["Where is order four eight two one three?", "Book me friday."]},
        tools={"tool_call": [[ORDER, BOOK], [BOOK, ORDER]]}, on_request=["tool_call"],
    )
    settings = BenchSettings(modes=["off", "grammar", "grammar+ngram"], temperatures=[0.0, 0.8],
                             max_new_tokens=8, warmup_tokens=2)
    records, modes = run_bench(engine, tokenizer, prompt_set, settings, hf_model=target)
    assert {r.segment for r in records} == {"chat"}  # tool_call runs only when asked

    settings.segments = ["chat", "tool_call"]
    records, modes = run_bench(engine, tokenizer, prompt_set, settings, hf_model=target)
    calls = [r for r in records if r.segment == "tool_call"]
    assert len(calls) == 3 * 2 * 2  # engine modes only: HF cannot decode under a grammar
    assert all(r.schema_valid and r.tool_call["name"] in {"lookup_order", "book_slot"}
               for r in calls), [(r.mode, r.tool_call) for r in calls]
    assert all(r.schema_valid is None for r in records if r.segment == "chat")

    report = build_report(records, modes, settings, prompt_set, engine)
    json_path, md_path = write_results(
        report, render_markdown(report["summary"], report_header(report)), tmp_path)
    data = json.loads(json_path.read_text())
    assert all(run["schema_valid"] for run in data["runs"] if run["segment"] == "tool_call")
    cells = {(c["temperature"], c["mode"]): c for c in data["summary"]["cells"]
             if c["segment"] == "tool_call"}
    assert cells[(0.0, "grammar")]["tokens_per_forward"] > cells[(0.0, "off")]["tokens_per_forward"]
    assert data["summary"]["lossless"]["grammar+ngram"]["mismatches"] == 0
    text = md_path.read_text()
    header = "| mode | T | tok/s | tok/fwd | × off | schema-valid |"
    assert f"## Tool calls: tool_call\n\n{header}" in text
    for mode in ("off", "grammar", "grammar+ngram"):
        assert f"| {mode} | 0.8 |" in text
    assert text.count("| 100% of 2 |") == 6
