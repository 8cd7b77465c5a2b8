"""The process-wide models a call's pipeline is built over."""


import asyncio
import os
import re
import threading
import time
from types import SimpleNamespace

import pytest

from audio.config import ASRConfig
from audio.loaders import load_whisper, numpy_blas_threads
from tests.voiceagent.serving import server_config
from tests.voiceagent.tiny_shared import tiny_shared
from voiceagent.config import load_config
from voiceagent.models import resolve
from voiceagent.pipeline import builder, stt
from voiceagent.pipeline.builder import build_call
from voiceagent.pipeline.speech_models import SpeechModels, _synthesising
from voiceagent.pipeline.speech_worker import SpeechWorker
from voiceagent.pipeline.stt import asr_threads

CORES = len(os.sched_getaffinity(0))


def test_a_call_over_shared_models_without_speech_models_is_refused_by_name(tmp_path):
    shared = tiny_shared()  # an LLM only, as a process serving the HTTP API alone has
    try:
        with pytest.raises(ValueError, match="no speech models"):
            build_call(server_config(tmp_path), shared, transport=None, on_turn=print)
    finally:
        shared.close()


@pytest.mark.parametrize("override,why", [
    ("tts.cpu_threads=1", "loaded for other settings: tts.cpu_threads=1 (loaded: 0)"),
    ("turn.stop=smart_turn", "no Smart Turn model is loaded"),
])
def test_a_call_whose_config_needs_other_speech_models_is_refused_by_name(
        tmp_path, override, why):
    shared = tiny_shared()
    shared.speech = SpeechModels.load(server_config(tmp_path), lambda _: None)
    try:
        with pytest.raises(ValueError, match=re.escape(why)):
            build_call(server_config(tmp_path, override), shared, transport=None, on_turn=print)
    finally:
        shared.close()


def test_a_tts_that_fails_while_the_engine_measures_beside_it_fails_the_measurement():
    class BrokenVoice:
        def synthesize(self, text):
            raise OSError("no espeak-ng data")

    with pytest.raises(RuntimeError, match="no espeak-ng data"):
        with _synthesising(BrokenVoice()):
            time.sleep(0.05)


@pytest.mark.parametrize("setting,engine_threads,expected", [
    ("auto", 1, max(1, CORES - 1)),  # the cores the engine leaves
    ("auto", CORES, 1),  # at least one
    ("auto", None, 0),  # no engine on this CPU: CTranslate2's default
    (3, 1, 3),  # a set count stands
    (0, 1, 0),  # CTranslate2's default
])
def test_whisper_runs_on_the_cores_the_engine_leaves(setting, engine_threads, expected):
    assert asr_threads(ASRConfig(cpu_threads=setting), engine_threads) == expected


def test_the_speech_models_load_whisper_on_the_cores_the_engine_leaves(tmp_path, monkeypatch):
    asked = []

    def spied(*args, **kwargs):
        asked.append(kwargs["cpu_threads"])
        return load_whisper(*args, **kwargs)

    monkeypatch.setattr(stt, "load_whisper", spied)
    speech = SpeechModels.load(server_config(tmp_path), lambda _: None, engine_threads=1)
    try:
        assert asked == [speech.asr_threads] == [max(1, CORES - 1)]
    finally:
        speech.close()


def test_a_negative_asr_thread_count_is_refused():
    with pytest.raises(ValueError, match="asr.cpu_threads must be auto"):
        ASRConfig(cpu_threads=-1)


def test_the_shared_models_run_whisper_beside_the_engines_threads(models):
    assert models.llm.threads >= 1  # the engine runs on this CPU
    assert models.speech.asr_threads == max(1, CORES - models.llm.threads)


def test_whisper_on_a_set_thread_count_gives_numpys_blas_as_many():
    before = numpy_blas_threads()
    try:
        load_whisper(resolve("whisper-tiny.en", "asr").location, device="cpu", cpu_threads=1)
        assert numpy_blas_threads() == [1] * len(before) and before
    finally:
        for count in set(before):
            numpy_blas_threads(count)


async def test_a_speech_worker_is_busy_only_while_a_job_runs():
    worker = SpeechWorker("test-worker")
    started, release = threading.Event(), threading.Event()

    def job() -> None:
        started.set()
        release.wait(5)

    try:
        assert not worker.busy()
        running = asyncio.ensure_future(worker.run(job))
        assert await asyncio.to_thread(started.wait, 5)
        assert worker.busy()
        release.set()
        await running
        assert not worker.busy()
    finally:
        worker.close()


@pytest.mark.parametrize("which", ["asr_worker", "tts_worker"])
async def test_the_speech_models_are_busy_while_whisper_or_piper_runs_a_job(models, which):
    """What the engine steps on fewer threads beside (`EngineWorker.share_cores`)."""
    started, release = threading.Event(), threading.Event()

    def job() -> None:
        started.set()
        release.wait(5)

    running = asyncio.ensure_future(getattr(models.speech, which).run(job))
    try:
        assert await asyncio.to_thread(started.wait, 5)
        assert models.speech.busy()
    finally:
        release.set()
        await running
    assert not models.speech.busy()


def test_the_engine_steps_on_the_shared_count_while_either_speech_model_runs(models, monkeypatch):
    shared = []
    worker = SimpleNamespace(call=lambda fn: fn(None),
                             share_cores=lambda *args: shared.append(args))
    monkeypatch.setattr(builder, "threads_beside", lambda *_: 1)
    builder._share_cores(load_config(None), worker, SimpleNamespace(threads=2), models.speech,
                         print)
    assert shared == [(models.speech.busy, 1, 2)]
