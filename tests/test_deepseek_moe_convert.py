"""`megapo convert` on the two families of the DeepSeekMoE block (deepseek_v3: MLA; glm4_moe: q/k/v biases, q/k
norms, partial rotary in rope_parameters; both: dense first layer, sigmoid router with expert bias, shared
expert): HF -> torch_dist saved under TP=2xEP=2, back to HF loaded under PP=2 (the
stages split between the dense-and-MoE first half and the MoE second half), with --verify (transformers vs the
learner on the converted weights). Reference: the source safetensors written by transformers, every tensor
compared with torch.equal, the routers' expert bias (a buffer) included; the checkpoint's expert bias read
with torch.distributed.checkpoint (no megapo code) is the source's. Config keys the Megatron model would not
reproduce are refused by name before any process starts."""

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
BIASES = [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2, 3)]


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


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def round_trip(request, tiny_model_factory, tmp_path_factory):
    source = Path(tiny_model_factory(request.param, layers=4, moe_ffn=32))
    tmp = tmp_path_factory.mktemp(f"{request.param}_convert")
    ckpt, back = tmp / "ckpt", tmp / "hf"
    convert("hf-to-megatron", "--hf", str(source), "--out", str(ckpt), "--tp", "2", "--ep", "2")
    log = convert("megatron-to-hf", "--ckpt", str(ckpt), "--out", str(back), "--pp", "2", "--verify")
    return dict(source=source, ckpt=ckpt, back=back, log=log)


def test_round_trip_is_bit_exact_expert_bias_included(round_trip):
    src, back = read_all(round_trip["source"]), read_all(round_trip["back"])
    assert sorted(back) == sorted(src)
    for name, ref in src.items():
        assert back[name].dtype == ref.dtype and torch.equal(back[name], ref), name
    assert all(src[b].abs().min() > 0 for b in BIASES)  # a bias left at zero would show
    assert "verify OK" in round_trip["log"]
    assert json.loads((round_trip["back"] / "config.json").read_text()) == json.loads(
        (round_trip["source"] / "config.json").read_text())


def test_checkpoint_holds_the_expert_bias(round_trip):
    import torch.distributed.checkpoint as dcp

    stored = {f"decoder.layers.{i}.mlp.router.expert_bias": torch.empty(8) for i in (1, 2, 3)}
    dcp.load(stored, storage_reader=dcp.FileSystemReader(str(round_trip["ckpt"])), no_dist=True)
    src = read_all(round_trip["source"])
    for i, bias in zip((1, 2, 3), BIASES):
        assert torch.equal(stored[f"decoder.layers.{i}.mlp.router.expert_bias"], src[bias]), i


@pytest.mark.parametrize("family, change, words", [
    ("deepseek_v3", dict(num_nextn_predict_layers=1), ["num_nextn_predict_layers=1", "multi-token-prediction"]),
    ("deepseek_v3", dict(moe_layer_freq=2), ["moe_layer_freq=2"]),
    ("deepseek_v3", dict(some_new_switch=True), ["'some_new_switch'", "not understood"]),
    ("deepseek_v3", dict(rope_interleave=False), ["rope_interleave"]),
    ("glm4_moe", dict(num_nextn_predict_layers=1), ["num_nextn_predict_layers=1", "multi-token-prediction"]),
    ("glm4_moe", dict(some_new_switch=True), ["'some_new_switch'", "not understood"]),
    ("glm4_moe", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                       "mrope_section": [8, 8]}), ["mrope_section"]),
    ("glm4_moe", dict(partial_rotary_factor=0.3), ["partial_rotary_factor=0.3", "disagree"]),
], ids=["ds-mtp", "ds-moe_layer_freq", "ds-unknown", "ds-rope_interleave", "glm-mtp", "glm-unknown", "glm-rope_key",
        "glm-two_rotary_factors"])
def test_configs_it_would_not_reproduce_are_refused(tiny_model_factory, tmp_path, capsys, family, change, words):
    source = Path(tiny_model_factory(family, layers=4, moe_ffn=32))
    hf = tmp_path / "hf"
    shutil.copytree(source, hf)
    config = {**json.loads((hf / "config.json").read_text()), **change}
    (hf / "config.json").write_text(json.dumps(config))
    code = megapo_main(["convert", "hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert code == 2 and all(w in err for w in words), err
    assert not (tmp_path / "ckpt").exists()
