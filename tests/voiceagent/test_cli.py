from voiceagent.cli import main


def test_unknown_set_key_exits_2_with_one_line(capsys):
    assert main(["doctor", "--set", "engine.nope=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown config key 'engine.nope'") and "\n" not in err


def test_pending_subcommand_says_which_issue_delivers_it(capsys):
    assert main(["serve"]) == 2
    assert "not available yet" in capsys.readouterr().err


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
