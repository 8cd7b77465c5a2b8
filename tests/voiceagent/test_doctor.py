"""`voiceagent doctor` with a GPU config on a machine without CUDA and without the hub: one line
for the CUDA it asks for, and each hub id named with its fix."""

import pytest
import torch

from voiceagent.commands.doctor import run_doctor
from voiceagent.config import load_config

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@pytest.fixture(scope="module")
def doctor():
    lines: list[str] = []
    cfg = load_config("gpu-qwen2.5-7b.yaml", ["tts.use_cuda=true"])
    return run_doctor(cfg, say=lines.append), lines


def test_a_config_that_asks_for_cuda_without_it_is_one_problem_line(doctor):
    report, lines = doctor
    cuda = [line for line in lines if "cuda:" in line and "FAIL" in line]
    assert len(cuda) == 1 and cuda[0].startswith("  FAIL cuda: the config asks for CUDA")
    for setting in ("engine.device: cuda", "asr.device: cuda", "tts.use_cuda: true"):
        assert setting in cuda[0]
    assert "cuda" in [check.name for check in report.problems]


def test_an_offline_hub_id_names_the_model_and_the_local_folder_fix(doctor):
    report, _ = doctor
    problems = {check.name: check.detail for check in report.problems}
    assert problems["llm target"].startswith("llm model 'Qwen/Qwen2.5-7B-Instruct' is a hub id")
    assert problems["llm target"].endswith("set engine.target to DIR")
    assert "hf download Systran/faster-whisper-small.en --local-dir DIR" in problems["asr"]
    assert problems["asr"].endswith("set asr.model to DIR")
