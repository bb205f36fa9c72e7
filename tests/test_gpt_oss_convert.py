"""`megapo convert` on gpt_oss: HF -> torch_dist saved under TP=2xEP=2, back to HF loaded under PP=2, with
--verify (transformers vs the learner on the converted weights). Reference: the source safetensors written by
transformers (experts fused across experts, gate/up interleaved, transposed), every tensor compared with
torch.equal; the checkpoint's attention sinks read with torch.distributed.checkpoint (no megapo code) are the
source's. Config keys the Megatron model would not reproduce are refused by name before any process starts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megapo.cli import main as megapo_main
from megapo.weights.safetensors_io import open_tensors

ROOT = Path(__file__).resolve().parents[1]


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open_tensors(path) as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def convert(*argv: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "megapo.cli", "convert", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def source(tiny_model_factory):
    return Path(tiny_model_factory("gpt_oss", moe_ffn=32))


@pytest.fixture(scope="module")
def round_trip(source, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("oss_convert")
    ckpt, back = tmp / "ckpt", tmp / "hf"
    convert("hf-to-megatron", "--hf", str(source), "--out", str(ckpt), "--tp", "2", "--ep", "2")
    log = convert("megatron-to-hf", "--ckpt", str(ckpt), "--out", str(back), "--pp", "2", "--verify")
    return dict(ckpt=ckpt, back=back, log=log)


def test_round_trip_is_bit_exact(source, round_trip):
    src, back = read_all(source), read_all(round_trip["back"])
    assert sorted(back) == sorted(src)
    for name, ref in src.items():
        assert back[name].dtype == ref.dtype and torch.equal(back[name], ref), name
    assert src["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 8  # fused across the 8 experts
    assert "verify OK" in round_trip["log"]
    assert json.loads((round_trip["back"] / "config.json").read_text()) == json.loads(
        (source / "config.json").read_text())


def test_checkpoint_holds_the_sinks_and_expert_biases(source, round_trip):
    """Megatron's layers are stacked on dim 0 (experts on dim 1); its fc2 bias of expert e is the file's
    down_proj_bias[e]."""
    import torch.distributed.checkpoint as dcp

    src = read_all(source)
    stored = {"decoder.layers.self_attention.core_attention.softmax_offset": torch.empty(2, 4),
              "decoder.layers.mlp.experts.experts.linear_fc2.bias": torch.empty(2, 8, 64)}
    dcp.load(stored, storage_reader=dcp.FileSystemReader(str(round_trip["ckpt"])), no_dist=True)
    for layer in (0, 1):
        assert torch.equal(stored["decoder.layers.self_attention.core_attention.softmax_offset"][layer],
                           src[f"model.layers.{layer}.self_attn.sinks"])
        assert torch.equal(stored["decoder.layers.mlp.experts.experts.linear_fc2.bias"][layer],
                           src[f"model.layers.{layer}.mlp.experts.down_proj_bias"])


@pytest.mark.parametrize("change, words", [
    (dict(rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                           "original_max_position_embeddings": 4096, "rope_theta": 150000.0, "mscale": 1.0}),
     ["rope parameters", "mscale"]),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0}), ["YaRN", "factor"]),
    (dict(swiglu_alpha=1.0), ["swiglu_alpha=1.0"]),
    (dict(experts_per_token=4), ["experts_per_token=4", "num_experts_per_tok=2"]),
    (dict(some_new_switch=True), ["'some_new_switch'", "not understood"]),
], ids=["yarn_mscale", "yarn_without_factor", "swiglu_alpha", "experts_per_token", "unknown"])
def test_configs_it_would_not_reproduce_are_refused(source, tmp_path, capsys, change, words):
    hf = tmp_path / "hf"
    shutil.copytree(source, hf)
    config = {**json.loads((hf / "config.json").read_text()), **change}
    (hf / "config.json").write_text(json.dumps(config))
    code = megapo_main(["convert", "hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert code == 2 and all(w in err for w in words), err
    assert not (tmp_path / "ckpt").exists()


def test_a_yarn_config_is_accepted(source):
    """gpt-oss's own YaRN rope parameters (and openai's initial_context_length) pass the converter's checks."""
    from megapo.convert.support import check_config

    hf = {**json.loads((source / "config.json").read_text()), "initial_context_length": 4096,
          "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                              "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}}
    _, spec = check_config(hf, "--hf")
    assert spec.yarn.factor == 32.0 and spec.rope_theta == 150000.0
