"""`megapo bench scaling`: layout names, refusals before any model or process, and one real run of two
2-process layouts (one torchrun launch) checked for the JSON keys, exact token counts and the PNGs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megapo.config import ConfigError
from tools.bench.scaling import SIZES, hf_config, parse_layout

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name, expect", [
    ("tp1", (1, 1, 1, 1)), ("tp2", (2, 1, 1, 1)), ("pp2", (1, 2, 1, 1)), ("dp2", (1, 1, 1, 2)),
    ("ep2", (1, 1, 2, 2)),  # ep needs tp*dp divisible by it: dp defaults to 2
    ("tp2xep2", (2, 1, 2, 1)), ("tp2xep4", (2, 1, 4, 2)), ("ep2xdp4", (1, 1, 2, 4)), ("PP2xTP2", (2, 2, 1, 1)),
])
def test_layout_names(name, expect):
    lay = parse_layout(name)
    assert (lay.tp, lay.pp, lay.ep, lay.dp) == expect
    assert lay.world_size == lay.tp * lay.pp * lay.dp


@pytest.mark.parametrize("name", ["tq2", "tp", "tp0", "tp2x", "tp2xtp2", "2tp", "tp2+pp2"])
def test_unknown_layout_names_are_refused(name):
    with pytest.raises(ConfigError) as err:
        parse_layout(name)
    assert err.value.args and "--layouts" in str(err.value)


def test_size_configs_are_what_the_tiny_writer_writes(tiny_model_factory):
    """hf_config (used to refuse layouts before writing models) equals the written config.json."""
    from megapo.layout import num_experts

    folder = tiny_model_factory("qwen3_moe", **SIZES["small"])
    written = json.loads((folder / "config.json").read_text())
    ours = hf_config(SIZES["small"])
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "moe_intermediate_size", "num_experts_per_tok", "vocab_size"):
        assert ours[key] == written[key], key
    assert num_experts(ours) == num_experts(written)


def _bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megapo.cli", "bench", "scaling", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (["--layouts", "tp2,zz2"], "unknown layout 'zz2'"),
    (["--layouts", "tp4", "--sizes", "small"], "layout tp4 does not fit size 'small': parallel.tp: tp=4 does not "
                                                "divide num_key_value_heads=2"),
    (["--layouts", "pp4", "--sizes", "small"], "pp=4 does not divide num_hidden_layers=2"),
    (["--layouts", "ep16", "--sizes", "small"], "needs 16 processes"),
    (["--layouts", "tp2xpp2xdp2"], "needs 8 processes; this launcher runs at most 4"),
    (["--layouts", "tp2,tp2"], "listed twice"),
    (["--sizes", "huge"], "unknown size 'huge'"),
    (["--steps", "0"], "--steps: must be >= 1"),
    (["--layouts", "dp4", "--prompts", "1", "--n", "2"], "fewer sequences than dp=4"),
])
def test_bad_arguments_are_refused_before_anything_starts(tmp_path, args, message, monkeypatch, capsys):
    """`megapo bench scaling` run in this process (megapo.cli.main, the command line's own dispatch): writing a
    model or starting a process fails the test, besides the output folder that must not exist."""
    import megapo.launch.local
    import tools.bench.scaling as scaling
    from megapo.cli import main

    def refuse(*a, **k):
        raise AssertionError("a model was written or a process started")

    for module, name in ((scaling, "write_models"), (scaling, "run_local"), (megapo.launch.local, "run_torchrun")):
        monkeypatch.setattr(module, name, refuse)
    out = tmp_path / "out"
    rc = main(["bench", "scaling", *args, "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert message in err
    assert not out.exists()  # no model written, no process started


def test_two_layouts_one_step_write_json_and_plots(tmp_path):
    out = tmp_path / "out"
    prompts, n, prompt_len, new = 2, 2, 8, 8
    done = _bench("--layouts", "tp2,pp2", "--sizes", "small", "--steps", "1", "--prompts", str(prompts), "--n",
                  str(n), "--prompt-len", str(prompt_len), "--max-new-tokens", str(new), "--out", str(out))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads((out / "scaling.json").read_text())
    assert report["device"] == "cpu" and "not speedups" in report["note"]
    assert sorted(r["layout"] for r in report["results"]) == ["pp2", "tp2"]
    for r in report["results"]:
        assert r["world_size"] == 2 and r["size"] == "small"
        assert len(r["peak_memory_bytes_per_rank"]) == 2
        assert all(m > 50 * 2**20 for m in r["peak_memory_bytes_per_rank"])  # a process with torch loaded
        for kind, groups in (("strong", prompts), ("weak", prompts * 2)):
            part = r[kind]
            # no stop tokens: every response is max_new_tokens long
            assert part["sequences"] == groups * n
            assert part["tokens"] == groups * n * (prompt_len + new)
            assert part["response_tokens"] == groups * n * new
            t = part["time_s"]
            assert set(t) == {"generate", "old_logp", "train", "weight_sync", "step"}
            assert t["step"] == pytest.approx(sum(t[p] for p in ("generate", "old_logp", "train", "weight_sync")))
            assert part["tokens_per_s_per_device"] == pytest.approx(part["tokens"] / t["step"] / 2)
            assert part["mfu"] is None  # CPU
        assert r["strong_speedup_vs_1proc"] is None  # no single-process layout in this run
    for name in ("strong_scaling.png", "weak_scaling.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_only_writes_specs_for_a_cluster_and_starts_nothing(tmp_path, monkeypatch, capsys):
    """--plan-only: no 4-process limit, one spec per world size, the per-rank command printed; no raw results.
    Run in this process (megapo.cli.main): starting a process fails the test."""
    import megapo.launch.local
    import tools.bench.scaling as scaling
    from megapo.cli import main

    def refuse(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(scaling, "run_local", refuse)
    monkeypatch.setattr(megapo.launch.local, "run_torchrun", refuse)
    out = tmp_path / "plan"
    rc = main(["bench", "scaling", "--layouts", "dp8,ep8,tp2", "--sizes", "small", "--plan-only", "--out", str(out)])
    done = capsys.readouterr()
    assert rc == 0, done.err[-3000:]
    spec8 = json.loads((out / "spec_world8.json").read_text())
    assert [r["parallel"] for r in spec8["runs"]] == [{"tp": 1, "pp": 1, "ep": 1, "dp": 8},
                                                       {"tp": 1, "pp": 1, "ep": 8, "dp": 8}]
    assert (out / "spec_world2.json").is_file() and (out / "models" / "small" / "config.json").is_file()
    assert f"-m tools.bench.scaling_worker --spec {out / 'spec_world8.json'}" in done.out
    assert not list(out.glob("raw_world*.jsonl"))
