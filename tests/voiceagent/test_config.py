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
    with pytest.raises(ConfigError, match=r"engine\.max_context: Input should be a valid integer"):
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


def test_missing_config_file_is_a_clear_error(tmp_path: Path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


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
