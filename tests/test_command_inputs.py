"""Bad input files of the small commands: `megapo logprobs` and `megapo plot` answer exit 2 naming the
file (and line) before any work, and `megapo plot` reads a run still being written."""

import json

import pytest

from megapo.cli import main


def _logprobs(model, tmp_path, content: bytes):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(content)
    return main(["logprobs", "--model", str(model), "--input", str(inp), "--output", str(tmp_path / "out.jsonl")])


@pytest.mark.parametrize("content, words", [
    (b"", ["--input", "in.jsonl holds no sequences"]),
    (b"\n\n", ["--input", "in.jsonl holds no sequences"]),
    (b'{"tokens": [1, 2]}\n{"tokens": [true, false, 1]}\n', ["in.jsonl:2:", "true/false are not token ids"]),
    (b'{"tokens": [1, 2]}\n{"tokens": [1, 2.0]}\n', ["in.jsonl:2:", "at least 2 integers"]),
    (b'{"tokens": [1, 2]}\n{"tokens": [1, \xff]}\n', ["in.jsonl:2:", "not UTF-8"]),
    (b'{"tokens": [1, 2]}\n{"tokens": [1, 2', ["in.jsonl:2:", "cut off"]),
])
def test_logprobs_bad_input_exit_2(tiny_moe, tmp_path, capsys, no_launch, content, words):
    assert _logprobs(tiny_moe, tmp_path, content) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, err
    assert not (tmp_path / "out.jsonl").exists()


def test_plot_missing_run_exit_2(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "no_such_run"), "--out", str(tmp_path / "c.png")]) == 2
    assert "no_such_run does not exist" in capsys.readouterr().err
    (tmp_path / "empty_run").mkdir()
    assert main(["plot", str(tmp_path / "empty_run"), "--out", str(tmp_path / "c.png")]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
    assert not (tmp_path / "c.png").exists()


def test_plot_skips_a_cut_off_last_line(tmp_path, capsys, caplog):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "reward": 0.1 * s} for s in (1, 2, 3)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (run / "metrics.jsonl").write_text(text + '{"step": 4, "rew')  # the run is writing step 4
    with caplog.at_level("WARNING"):
        assert main(["plot", str(run), "--out", str(tmp_path / "c.png")]) == 0
    assert "reward: 3 points" in capsys.readouterr().out
    assert (tmp_path / "c.png").stat().st_size > 0
    assert any("metrics.jsonl:4" in r.getMessage() for r in caplog.records)
    (run / "metrics.jsonl").write_text(text.replace('"step": 2', '"step": 2,,'))  # damaged mid-file
    assert main(["plot", str(run), "--out", str(tmp_path / "d.png")]) == 2
    assert "metrics.jsonl:2: not valid JSON" in capsys.readouterr().err
