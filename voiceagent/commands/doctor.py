"""`voiceagent doctor`: environment, devices, and a timed load of every configured model."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from llm_engine.methods import model_settings
from voiceagent.config import CONFIGS_DIR, REPO_ROOT, Config

if TYPE_CHECKING:
    from llm_engine.loading import LoadedModel


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    seconds: float | None = None


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)

    @property
    def problems(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]


def environment_lines() -> list[str]:
    import torch
    import transformers

    lines = [
        f"python {platform.python_version()} ({platform.machine()}), torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
    ]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            bf16 = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
            lines.append(f"device: cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, {bf16}")
    else:
        lines.append(
            f"device: cpu, torch threads {torch.get_num_threads()} of {os.cpu_count()} cores "
            "(no CUDA)"
        )
    where = "the checkout" if CONFIGS_DIR == REPO_ROOT / "configs" else "the installed package"
    lines.append(f"configs: {CONFIGS_DIR} ({where})")
    return lines


def cuda_settings(cfg: Config) -> dict[str, str | None]:
    """Each setting that asks for CUDA -> why this machine cannot give it (None: it can), as
    the library that would run on it sees it."""
    asked: dict[str, str | None] = {}
    if cfg.llm.backend == "engine" and cfg.engine.device == "cuda":
        import torch

        asked["engine.device: cuda"] = (None if torch.cuda.is_available()
                                        else "torch sees no CUDA device")
    if cfg.asr.device == "cuda":
        import ctranslate2

        asked["asr.device: cuda"] = (None if ctranslate2.get_cuda_device_count() > 0
                                     else "CTranslate2 sees no CUDA device")
    if cfg.tts.use_cuda:
        import onnxruntime

        asked["tts.use_cuda: true"] = (
            None if "CUDAExecutionProvider" in onnxruntime.get_available_providers()
            else "onnxruntime has no CUDAExecutionProvider: that takes onnxruntime-gpu")
    return asked


def _cuda_check(report: Report, cfg: Config, say: Callable[[str], None]) -> None:
    """One line when the config asks for CUDA: what it asks, and what this machine lacks."""
    asked = cuda_settings(cfg)
    if not asked:
        return
    lacking = {setting: why for setting, why in asked.items() if why}
    if lacking:
        detail = ("the config asks for CUDA this machine cannot give: "
                  + "; ".join(f"{setting} ({why})" for setting, why in lacking.items())
                  + "; run it on a GPU machine, or set those to auto/cpu/false "
                  "(configs/default.yaml runs on a CPU)")
    else:
        detail = "available for " + ", ".join(asked)
    report.checks.append(Check("cuda", not lacking, detail))
    say(f"  {'FAIL' if lacking else 'ok  '} cuda: {detail}")


def _timed(report: Report, name: str, load: Callable[[], str], say: Callable[[str], None]):
    t0 = time.perf_counter()
    try:
        detail = load()
    except Exception as exc:  # doctor reports every failure as one line and goes on
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        report.checks.append(Check(name, False, first))
        say(f"  FAIL {name}: {first}")
        return
    dt = time.perf_counter() - t0
    report.checks.append(Check(name, True, detail, dt))
    say(f"  ok   {name}: {detail} [{dt:.2f} s]")


def run_doctor(cfg: Config, say: Callable[[str], None] = print) -> Report:
    from audio.loaders import load_piper, load_silero, load_whisper
    from voiceagent.llm_setup import load_draft, load_eagle, load_llm
    from voiceagent.models import resolve

    for line in environment_lines():
        say(line)
    report = Report()
    _cuda_check(report, cfg, say)
    say("models:")
    quiet = lambda msg: say(f"       {msg}")  # noqa: E731 - progress lines under the model
    loaded = {}

    def llm(role: str, load: Callable[[], LoadedModel]) -> str:
        m = load()
        loaded[role] = m
        how = "from the de-quantised cache" if m.from_cache else "fresh"
        return (
            f"{m.name} -> {m.source} ({m.param_bytes / 2**20:.0f} MiB {m.dtype} on {m.device}, "
            f"{how})"
        )

    engine = cfg.engine
    _timed(report, "llm target",
           lambda: llm("target", lambda: load_llm(engine.target, engine, cfg.paths.cache_dir,
                                                  quiet)), say)
    method = engine.speculation.method
    if method in model_settings() and "target" in loaded:
        target = loaded["target"]
        load = (partial(load_draft, engine, target, cfg.paths.cache_dir, quiet)
                if method == "draft" else partial(load_eagle, engine, target, quiet))
        _timed(report, f"llm {method}", lambda: llm("draft", load), say)

    def asr() -> str:
        r = resolve(cfg.asr.model, "asr", cfg.paths.cache_dir, setting="asr.model")
        load_whisper(r.location, cfg.asr.device, cfg.asr.compute_type)
        return f"{r.name} -> {r.location}"

    def tts() -> str:
        r = resolve(cfg.tts.voice, "tts", cfg.paths.cache_dir, setting="tts.voice")
        voice = load_piper(r.location, cfg.tts.use_cuda)
        return f"{r.name} -> {r.location} ({voice.config.sample_rate} Hz)"

    def vad() -> str:
        r = resolve(cfg.vad.model, "vad", cfg.paths.cache_dir, setting="vad.model")
        load_silero(r.location)
        return f"{r.name} -> {r.location}"

    if "target" in loaded:
        _pair_card(report, cfg, loaded, say)
    _timed(report, "asr", asr, say)
    _timed(report, "tts", tts, say)
    _timed(report, "vad", vad, say)
    _timed(report, "tools", lambda: tools(cfg), say)
    return report


def tools(cfg: Config) -> str:
    from voiceagent.tools import load_tools

    loaded = load_tools(cfg.agent.tools)
    return ", ".join(t.name for t in loaded) if loaded else "none configured"


def _pair_card(report: Report, cfg: Config, loaded: dict, say: Callable[[str], None]) -> None:
    """Check the draft/target contract and print the pair card."""
    from llm_engine.contract import make_pair_card
    from voiceagent.llm_setup import resident_bytes

    target, draft = loaded["target"], loaded.get("draft")
    if cfg.engine.speculation.method in model_settings() and draft is None:
        return  # the draft's own failure is already reported
    try:
        card = make_pair_card(target, draft, cfg.engine, resident_bytes(target, draft))
    except ValueError as exc:
        first = str(exc).strip().splitlines()[0]
        report.checks.append(Check("pair", False, first))
        say(f"  FAIL pair: {exc}")
        return
    report.checks.append(Check("pair", True, card.card_hash))
    say(f"  ok   pair: compatible, resident {card.resident_bytes / 2**20:.0f} MiB")
    say("pair card:")
    for line in card.to_json().splitlines():
        say(f"  {line}")
