import json
import socket

from voiceagent.cli import main


def test_unknown_set_key_exits_2_with_one_line(capsys):
    assert main(["doctor", "--set", "engine.nope=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --set engine.nope=1: unknown config key 'engine.nope'")
    assert "\n" not in err


def test_serve_with_a_missing_model_fails_before_binding_a_port(capsys):
    assert main(["serve", "--set", "tts.voice=/nowhere/voice.onnx"]) == 2
    err = capsys.readouterr().err  # pipecat's import banner may come first
    assert err.strip().splitlines()[-1].startswith("error: tts model '/nowhere/voice.onnx'")
    assert "Traceback" not in err


def test_serve_on_a_busy_port_exits_3_before_loading_models_and_names_a_free_port(capsys):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 3
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    prefix = f"error: cannot listen on 127.0.0.1:{port}: port {port} is in use; try --port "
    assert last.startswith(prefix)
    socket.create_server(("127.0.0.1", int(last.removeprefix(prefix)))).close()  # it is free
    assert "loading models" not in err


def test_doctor_reports_a_missing_model_in_one_line_and_fails(capsys, tmp_path):
    code = main([
        "doctor",
        "--set", f"engine.target={tmp_path}/missing.gguf",
        "--set", "tts.voice=/nowhere/voice.onnx",
        "--set", f"paths.cache_dir={tmp_path}",
    ])
    assert code == 1
    captured = capsys.readouterr()
    assert "FAIL llm target: llm model" in captured.out
    assert "FAIL tts: tts model '/nowhere/voice.onnx' not found" in captured.out
    assert "ok   asr" in captured.out and "ok   vad" in captured.out
    assert "Traceback" not in captured.out + captured.err
    assert "2 problem(s)" in captured.err


def test_chat_json_prints_text_token_ids_and_stats(capsys):
    code = main(["chat", "What is 2 plus 2?", "--json", "--max-new-tokens", "8", "--seed", "1"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] and len(out["token_ids"]) <= 8
    stats = out["stats"]
    for key in ("ttft_ms", "itl_ms", "steps", "k_history", "accepted_by_pos", "tokens_per_s"):
        assert key in stats


def test_doctor_refuses_an_incompatible_draft(capsys, tmp_path):
    from tests.llm_engine.tiny_models import make_model, make_tokenizer

    tok = make_tokenizer()
    make_model(len(tok)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    code = main([
        "doctor", "--set", "engine.speculation.method=draft", "--set", f"engine.draft={tmp_path}",
    ])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL pair:" in out and "vocabular" in out.lower()
