"""Early response preparation and turn-taking, through the real pipeline: embedded models,
synthesised caller speech.

The hangover (vad.stop_secs) is raised here so that a preparation certainly starts inside it on
any machine: one Whisper run alone takes about 350 ms on two cores.
"""

import asyncio
import re

import numpy as np
import pytest

from tests.audio.speech import silence, speech
from voiceagent.config import load_config, store_path
from voiceagent.dashboard.store import SQLiteTurnStore, open_store
from voiceagent.sim.call import RATE, simulate_call

HANGOVER_S = 3.2  # long enough for the pause transcript and the prepared reply's first audio
MID_PAUSE_S = 2.5  # shorter than the hangover: the caller goes on after it
BARGE_IN_BOUND_MS = 600


def _voiced(text: str) -> np.ndarray:
    """Speech without Piper's leading and trailing silence, so pauses are exactly as placed."""
    audio = speech(text)
    loud = np.flatnonzero(np.abs(audio.astype(np.int32)) > 500)
    return audio[loud[0] : loud[-1] + 1]


def _caller(*parts) -> np.ndarray:
    return np.concatenate([_voiced(p) if isinstance(p, str) else silence(p) for p in parts])


def _energy(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(x.astype(np.float64) ** 2))) if len(x) else 0.0


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return load_config(None, [f"paths.runs_dir={tmp_path_factory.mktemp('runs')}",
                              f"vad.stop_secs={HANGOVER_S}", "turn.prepare=true"])


@pytest.fixture(scope="module")
def shared(cfg, models):
    """The session's embedded models: this module's config differs only per call."""
    assert models.speech.serves(cfg) is None
    return models


@pytest.fixture(scope="module")
def paused_call(cfg, shared):
    """The caller pauses mid-sentence, shorter than the hangover, then finishes the sentence."""
    first, second = "What is the capital", "of Spain, and why is it there?"
    audio = _caller(0.5, first, MID_PAUSE_S, second, HANGOVER_S + 4.0)
    speech_end = 0.5 + (len(_voiced(first)) + len(_voiced(second))) / RATE + MID_PAUSE_S
    store = open_store(cfg)
    try:
        return asyncio.run(simulate_call(cfg, shared, audio, store=store)), speech_end
    finally:
        store.close()


def test_caller_who_goes_on_after_a_short_pause_gets_an_answer_to_the_whole_sentence(
        paused_call):
    result, speech_end = paused_call
    [turn] = result.turns
    assert turn.preparation.discarded >= 1  # the reply prepared at the pause was dropped
    assert turn.preparation.discarded_audio_ms > 0  # ... after its first phrase was synthesised
    assert turn.preparation.discarded_tokens > 0
    assert turn.preparation.committed  # the answer was prepared at the sentence's end
    assert "spain" in turn.user_text.lower()
    assert turn.bot_text.strip()
    # Nothing of the discarded reply was heard: the bot is silent while the caller speaks.
    assert _energy(result.bot[: int(speech_end * RATE)]) == 0.0


def test_discarded_preparation_leaves_no_context_change_and_no_stored_turn(
        paused_call, cfg):
    result, _ = paused_call
    roles = [m["role"] for m in result.messages if m["role"] != "system"]
    assert roles == ["user", "assistant"]
    [user] = [m["content"] for m in result.messages if m["role"] == "user"]
    assert "spain" in user.lower()  # the whole sentence, not the words before the pause
    stored = SQLiteTurnStore(store_path(cfg)).call(result.call_id)
    assert len(stored["turns"]) == 1
    assert stored["turns"][0]["preparation"]["discarded"] >= 1


async def test_committed_preparation_says_what_the_unprepared_path_says(cfg, shared):
    audio = _caller(0.5, "What is the capital of France?", HANGOVER_S + 4.0)
    prepared = await simulate_call(cfg, shared, audio)
    plain_cfg = cfg.model_copy(deep=True)
    plain_cfg.turn.prepare = False
    plain = await simulate_call(plain_cfg, shared, audio)
    [with_prep], [without] = prepared.turns, plain.turns
    assert with_prep.preparation.committed and with_prep.preparation.discarded == 0
    assert with_prep.preparation.lead_ms > 0  # it started before the turn was confirmed
    assert without.preparation.prepared == 0
    assert with_prep.user_text == without.user_text
    assert with_prep.llm_text == without.llm_text  # greedy: the same reply, token for token
    assert with_prep.bot_text == without.bot_text  # and the same words spoken


@pytest.fixture(scope="module")
def barge_in_call(cfg, shared):
    """A long story, a backchannel over it, then a real barge-in."""
    talkative = cfg.model_copy(deep=True)
    talkative.vad.stop_secs = 0.3
    talkative.turn.min_interrupt_s = 0.7  # "Mm-hmm." is 0.49 s of speech
    talkative.agent.system_prompt = "Always answer with a long story of at least ten sentences."
    talkative.engine.sampling.max_new_tokens = 200
    ask, backchannel, stop = "Tell me a long story about a dragon.", "Mm-hmm.", \
        "Stop, stop, please stop the story now."
    audio = _caller(0.5, ask, 4.5, backchannel, 3.0, stop, 5.0)
    backchannel_end = 0.5 + (len(_voiced(ask)) + len(_voiced(backchannel))) / RATE + 4.5
    return asyncio.run(simulate_call(talkative, shared, audio)), backchannel_end


def test_backchannel_does_not_interrupt_but_a_real_barge_in_does(barge_in_call):
    result, backchannel_end = barge_in_call
    first = result.turns[0]
    # The bot kept talking through the backchannel ...
    after = result.bot[int((backchannel_end + 0.8) * RATE) : int((backchannel_end + 2.8) * RATE)]
    assert _energy(after) > 300
    # ... and stopped soon after the real barge-in started.
    assert first.interrupted
    assert first.barge_in_to_silence_ms is not None
    assert first.barge_in_to_silence_ms < 700 + BARGE_IN_BOUND_MS  # it must last 0.7 s first


def test_an_interrupted_turn_records_the_words_the_caller_heard(barge_in_call):
    result, _ = barge_in_call
    first = result.turns[0]
    assert first.interrupted
    heard, generated = (_words(t) for t in (first.bot_text, first.llm_text))
    # Some of the story was played before the barge-in, and less than was generated.
    assert 0 < len(heard) < len(generated)
    assert generated[:len(heard)] == heard


def _words(text: str) -> list[str]:
    return re.sub(r"[^\w\s]", " ", text.casefold()).split()


def test_turn_with_a_discarded_preparation_has_every_stage_of_the_committed_reply(paused_call):
    result, _ = paused_call
    [turn] = result.turns
    assert turn.preparation.discarded >= 1
    stages = ("asr_final_ms", "prefill_ms", "first_token_ms", "first_clause_ms",
              "tts_first_chunk_ms", "chunk_to_audio_ms")
    missing = [s for s in stages if getattr(turn.breakdown, s) is None]
    assert not missing, f"stages not measured: {missing} in {turn.breakdown}"
