"""`voiceagent report`: hand-built turns in a real SQLite turn store, the report's numbers against
`dashboard.stats.overview` of the same turns, the plots, and the one-line errors."""

import re
import time
from dataclasses import asdict
from datetime import datetime

import pytest

from llm_engine.stats import RequestStats, StepStats
from voiceagent.cli import main
from voiceagent.commands.report import parse_since
from voiceagent.dashboard.stats import overview
from voiceagent.dashboard.store import SQLiteTurnStore
from voiceagent.pipeline.turn_record import Percentiles, TurnRecord

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOTS = ("clocks", "accepted", "rejections", "draft_verify", "waterfall")
NOW = time.time()


def engine_stats(method: str, steps: list[tuple[int, int, int]], itl: list[float]) -> dict:
    """RequestStats as the engine reports them; steps are (k, drafted, accepted)."""
    stats = RequestStats(method=method, prefill_ms=40.0, itl_ms=itl)
    for k, drafted, accepted in steps:
        stats.record_step(StepStats(
            k=k, drafted=drafted, accepted=accepted,
            rejection_pos=accepted if accepted < drafted else None,
            committed=accepted + 1, draft_ms=0.1 * drafted, verify_ms=12.0 + drafted,
        ))
    return stats.to_dict()


def turn(call_id: str, n: int, age_s: float, method: str, clock3: float, clock1: float,
         interrupted: bool = False) -> dict:
    steps = [(0, 0, 0)] * 3 if method == "off" else [(4, 4, 4), (4, 4, 1), (4, 3, 0)]
    itl = [10.0, 11.0, 30.0] if method == "off" else [0.0, 14.0, 0.0, 15.0]
    return {
        "call_id": call_id, "turn": n, "started_at": NOW - age_s,
        "user_text": "hello", "bot_text": "hi there", "llm_text": "hi there, friend",
        "interrupted": interrupted,
        "clocks": {"request_to_first_token_ms": clock1, "itl_ms": asdict(Percentiles.of(itl)),
                   "turn_end_to_first_audio_ms": clock3},
        "breakdown": {"user_speech_ms": 900.0, "vad_hangover_ms": 200.0, "asr_final_ms": 80.0,
                      "transcript_to_request_ms": 2.0, "prefill_ms": 40.0,
                      "first_token_ms": clock1, "first_clause_ms": 90.0,
                      "tts_first_chunk_ms": 60.0, "chunk_to_audio_ms": 5.0},
        "engine": engine_stats(method, steps, itl),
        "barge_in_to_silence_ms": 150.0 if interrupted else None,
    }


RECENT = [  # two calls, two methods, one interrupted turn, within the last hour
    turn("call-off", 1, 3000, "off", 700.0, 110.0),
    turn("call-off", 2, 2900, "off", 760.0, 120.0),
    turn("call-ngram", 1, 600, "ngram", 500.0, 90.0),
    turn("call-ngram", 2, 500, "ngram", 420.0, 80.0, interrupted=True),
    turn("call-ngram", 3, 400, "ngram", 610.0, 95.0),
]
OLD = [turn("call-old", 1, 3 * 86400, "off", 9000.0, 4000.0)]  # three days ago


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "turns.sqlite"
    store = SQLiteTurnStore(path)
    for d in OLD + RECENT:
        store.write(TurnRecord.from_dict(d))
    assert store.flush()
    store.close()
    return path


def report(path, out, *extra) -> int:
    return main(["report", "--set", f"store.path={path}", "--out", str(out), *extra])


def md_rows(text: str) -> dict[str, list[str]]:
    """Markdown table rows: first cell -> the other cells."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0]] = cells[1:]
    return rows


def last_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()  # pipecat's import banner may come first
    return err.splitlines()[-1]


def ms(x) -> str:
    return "–" if x is None else f"{x:.1f}"


def test_markdown_numbers_equal_the_dashboard_overview(db, tmp_path):
    assert report(db, tmp_path / "r.md") == 0
    rows = md_rows((tmp_path / "r.md").read_text())
    ov = overview(OLD + RECENT)
    columns = [ov, ov["by_method"]["off"], ov["by_method"]["ngram"]]
    assert rows[""] == ["all", "off", "ngram"]
    assert rows["turns"] == ["6", "3", "3"]
    assert rows["calls"] == ["3", "2", "1"]
    for clock, label, qs in (
        ("turn_end_to_first_audio_ms", "turn end → first audio", (50, 95, 99)),
        ("request_to_first_token_ms", "request → first token", (50, 95)),
        ("itl_ms", "inter-token latency", (50, 95, 99)),
    ):
        for q in qs:
            assert rows[f"{label} p{q} (ms)"] == [ms(s[clock][f"p{q}"]) for s in columns]
    assert rows["accepted tokens / speculative step"] == ["1.67", "–", "1.67"]
    assert rows["interrupted share (turns)"] == ["16.7% (1)", "0.0% (0)", "33.3% (1)"]
    assert rows["VAD hangover (turn end → VAD stop)"] == ["200.0"] * 3
    assert ov["by_method"]["ngram"]["turn_end_to_first_audio_ms"]["p50"] == 500.0


def test_html_has_the_tables_and_the_plots_beside_it(db, tmp_path):
    assert report(db, tmp_path / "r.html") == 0
    page = (tmp_path / "r.html").read_text()
    assert page.startswith("<!doctype html>") and "<table>" in page
    assert "<td>500.0</td>" in page  # ngram turn end → first audio p50
    assert not re.search(r"(src|href)=\"(https?:)?//", page)  # nothing external
    for name in PLOTS:
        assert f'<img src="r_files/{name}.png"' in page
        png = (tmp_path / "r_files" / f"{name}.png").read_bytes()
        assert png.startswith(PNG_SIGNATURE) and len(png) > 1000
    assert "call-ngram" in page  # the waterfall shows the most recent call


def test_markdown_links_the_plots(db, tmp_path):
    assert report(db, tmp_path / "out" / "review.md") == 0
    text = (tmp_path / "out" / "review.md").read_text()
    for name in PLOTS:
        assert f"(review_files/{name}.png)" in text
        assert (tmp_path / "out" / "review_files" / f"{name}.png").read_bytes()[:8] == \
            PNG_SIGNATURE


def test_since_excludes_older_turns(db, tmp_path):
    assert report(db, tmp_path / "r.md", "--since", "24h") == 0
    rows = md_rows((tmp_path / "r.md").read_text())
    ov = overview(RECENT)
    assert rows["turns"] == ["5", "2", "3"]
    assert rows["turn end → first audio p99 (ms)"][0] == ms(
        ov["turn_end_to_first_audio_ms"]["p99"])


def test_since_accepts_durations_and_iso_times():
    assert parse_since("90m", 10_000.0) == 10_000.0 - 5400
    assert parse_since("7d", 1e6) == 1e6 - 7 * 86400
    assert parse_since("2026-11-30", 0) == datetime(2026, 11, 30).timestamp()
    assert parse_since("2026-11-30T06:00", 0) == datetime(2026, 11, 30, 6).timestamp()


def test_an_empty_store_says_no_turns(tmp_path):
    path = tmp_path / "empty.sqlite"
    SQLiteTurnStore(path).close()
    assert report(path, tmp_path / "r.md") == 0
    assert "No turns in the window." in (tmp_path / "r.md").read_text()


def test_a_missing_store_is_a_one_line_error(tmp_path, capsys):
    missing = tmp_path / "nope.sqlite"
    assert report(missing, tmp_path / "r.html") == 2
    assert last_error_line(capsys).startswith(f"error: no turn store at {missing}")
    assert not missing.exists() and not (tmp_path / "r.html").exists()


def test_a_bad_since_is_a_one_line_error(db, tmp_path, capsys):
    assert report(db, tmp_path / "r.html", "--since", "yesterday") == 2
    assert last_error_line(capsys).startswith("error: --since 'yesterday' is neither")


def test_a_bad_extension_is_a_one_line_error(db, tmp_path, capsys):
    assert report(db, tmp_path / "r.pdf") == 2
    assert last_error_line(capsys).startswith("error: --out")
    assert not (tmp_path / "r.pdf").exists()


def test_plots_without_speculative_steps_are_left_out_with_a_note(tmp_path):
    path = tmp_path / "off.sqlite"
    store = SQLiteTurnStore(path)
    for d in RECENT[:2]:  # method off only
        store.write(TurnRecord.from_dict(d))
    assert store.flush()
    store.close()
    assert report(path, tmp_path / "r.md") == 0
    text = (tmp_path / "r.md").read_text()
    assert "Not drawn: no speculative steps in the window." in text
    assert "r_files/accepted.png" not in text
    assert not (tmp_path / "r_files" / "accepted.png").exists()
    assert (tmp_path / "r_files" / "waterfall.png").read_bytes()[:8] == PNG_SIGNATURE
