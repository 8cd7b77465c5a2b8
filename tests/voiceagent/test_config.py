from pathlib import Path

import pytest

from voiceagent.config import REPO_ROOT, ConfigError, load_config


def test_default_config_loads_the_embedded_models():
    cfg = load_config()
    assert cfg.engine.target == "smollm2-135m-instruct"
    assert cfg.asr.model == "whisper-tiny.en"
    assert cfg.server.host == "127.0.0.1"


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "configs").glob("*.yaml")), ids=str)
def test_every_shipped_config_validates(path):
    load_config(path)


def test_override_sets_a_nested_typed_value():
    cfg = load_config(None, ["engine.speculation.num_draft_tokens=6", "engine.sampling.stop=['.']"])
    assert cfg.engine.speculation.num_draft_tokens == 6
    assert cfg.engine.sampling.stop == ["."]


def test_unknown_override_key_is_refused_with_the_valid_keys():
    with pytest.raises(ConfigError, match=r"unknown config key 'engine\.speculation\.k'.*"
                                          r"valid keys: method, num_draft_tokens"):
        load_config(None, ["engine.speculation.k=4"])


def test_wrong_type_is_refused():
    with pytest.raises(ConfigError, match=r"^--set engine\.max_context=lots: Input should be a "
                                          r"valid integer"):
        load_config(None, ["engine.max_context=lots"])


def test_bad_choice_lists_the_valid_choices():
    known = r"known: draft, eagle, grammar, ngram, off \(or grammar\+<one>\)"
    with pytest.raises(ConfigError, match=f"method 'medusa'; {known}"):
        load_config(None, ["engine.speculation.method=medusa"])


def test_unknown_key_in_yaml_is_refused(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  targett: x\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'engine\.targett'.*target, draft"):
        load_config(bad)


def test_override_without_equals_is_refused():
    with pytest.raises(ConfigError, match="must look like key=value"):
        load_config(None, ["engine.device"])


def test_missing_config_file_lists_the_shipped_configs(tmp_path: Path):
    with pytest.raises(ConfigError, match="config file not found") as err:
        load_config(tmp_path / "nope.yaml")
    assert "default.yaml, gpu-llama3.1-8b.yaml, gpu-qwen2.5-7b.yaml" in str(err.value)


def test_a_bad_set_value_names_the_flag_and_suggests_the_nearest_value():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["engine.speculation.method=eagel"])
    msg = str(err.value)
    assert msg.startswith("--set engine.speculation.method=eagel: unknown speculation method")
    assert msg.endswith("did you mean 'eagle'?")
    assert "default.yaml" not in msg and "num_draft_tokens" not in msg  # no section dump


def test_an_unknown_set_key_suggests_the_nearest_key():
    with pytest.raises(ConfigError, match=r"^--set engine\.speculation\.methd=off: unknown config "
                                          r"key 'engine\.speculation\.methd' \(did you mean "
                                          r"'method'\?\)"):
        load_config(None, ["engine.speculation.methd=off"])


def test_a_bad_value_from_the_environment_names_its_variable(monkeypatch):
    monkeypatch.setenv("VOICEAGENT_ENGINE__DEVICE", "cdua")
    with pytest.raises(ConfigError, match=r"^environment variable VOICEAGENT_ENGINE__DEVICE: "
                                          r"engine\.device: .*did you mean 'cuda'\?$"):
        load_config()


def test_a_bad_value_in_a_file_names_the_file_and_the_key(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("turn:\n  stop: smart\n")
    with pytest.raises(ConfigError, match=f"^config file {bad}: turn\\.stop: .*'vad' or "
                                          "'smart_turn'.*did you mean 'smart_turn'\\?$"):
        load_config(bad)


@pytest.mark.parametrize("name", ["gpu-llama3.1-8b.yaml", "gpu-qwen2.5-7b.yaml"])
def test_gpu_configs_keep_the_defaults_tools_prompt_and_limits(name):
    default, gpu = load_config(), load_config(name)
    assert gpu.agent.tools and gpu.agent == default.agent
    assert gpu.server == default.server
    assert gpu.engine.device == "cuda" and gpu.engine.speculation.method == "draft"


def test_extends_merges_sections_key_by_key_and_replaces_values(tmp_path: Path):
    (tmp_path / "base.yaml").write_text(
        "engine:\n  speculation:\n    method: off\n    gate: false\n"
        "agent:\n  tools: [voiceagent.tools.demo]\n  tool_filler: Hold on.\n")
    child = tmp_path / "child.yaml"
    child.write_text("extends: base.yaml\nengine:\n  speculation:\n    num_draft_tokens: 6\n"
                     "agent:\n  tools: []\n")
    cfg = load_config(child)
    spec = cfg.engine.speculation
    assert (spec.method, spec.gate, spec.num_draft_tokens) == ("off", False, 6)
    assert cfg.agent.tools == [] and cfg.agent.tool_filler == "Hold on."


def test_extends_finds_a_shipped_config_from_another_folder(tmp_path: Path):
    child = tmp_path / "mine.yaml"
    child.write_text("extends: default.yaml\nengine:\n  speculation:\n    method: off\n")
    cfg = load_config(child)
    assert cfg.engine.speculation.method == "off" and cfg.agent == load_config().agent


def test_a_config_that_extends_itself_is_refused(tmp_path: Path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match="extends itself"):
        load_config(tmp_path / "a.yaml")


def test_a_config_without_extends_starts_from_the_built_in_defaults(tmp_path: Path):
    plain = tmp_path / "plain.yaml"
    plain.write_text("engine:\n  speculation:\n    method: off\n")
    assert load_config(plain).agent.tools == []


def test_secrets_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("VOICEAGENT_TOKEN", "s3cret")
    monkeypatch.setenv("TWILIO_AUTH_TOKEN", "tw-auth")
    cfg = load_config()
    assert (cfg.server.token, cfg.server.twilio_auth_token) == ("s3cret", "tw-auth")


def test_any_key_comes_from_the_environment_and_set_wins_over_it(monkeypatch):
    monkeypatch.setenv("VOICEAGENT_ENGINE__SPECULATION__METHOD", "off")
    monkeypatch.setenv("VOICEAGENT_SERVER__MAX_CALLS", "3")
    monkeypatch.setenv("VOICEAGENT_SERVER__ALLOWED_ORIGINS", "[https://ops.example]")
    cfg = load_config()
    assert cfg.engine.speculation.method == "off" and cfg.server.max_calls == 3
    assert cfg.server.allowed_origins == ["https://ops.example"]
    assert load_config(None, ["server.max_calls=2"]).server.max_calls == 2


def test_an_unknown_key_from_the_environment_names_its_variable(monkeypatch):
    monkeypatch.setenv("VOICEAGENT_SERVER__MAX_CALS", "3")
    with pytest.raises(ConfigError, match="VOICEAGENT_SERVER__MAX_CALS"):
        load_config()


def test_off_means_the_method_named_off_not_false(tmp_path: Path):
    cfg = load_config(None, ["engine.speculation.method=off"])
    assert cfg.engine.speculation.method == "off"
    path = tmp_path / "c.yaml"
    path.write_text("engine:\n  speculation:\n    method: off\n    gate: false\n")
    cfg = load_config(path)
    assert cfg.engine.speculation.method == "off" and cfg.engine.speculation.gate is False


def test_a_config_cannot_decode_replies_past_their_eos():
    with pytest.raises(ConfigError, match="ignore_eos is for throughput benchmarks"):
        load_config(None, ["engine.sampling.ignore_eos=true"])
