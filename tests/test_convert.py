"""`megapo convert`: HF <-> Megatron torch_dist round trips, resharding on load, --verify, refusals.

Reference for the round trips: the source safetensors written by transformers (every tensor compared
with torch.equal). Reference for --verify: transformers' fp32 forward. The multi-process part runs in
few torchrun launches: all hf-to-megatron conversions in one, all megatron-to-hf conversions (plus a
verify that must fail) in a second, a trainer checkpoint in a third, a forced failure in a fourth.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megapo.cli import main as megapo_main
from megapo.commands import convert

FAMILIES = ("qwen3_moe", "qwen2", "mixtral", "qwen3")
CASES = (*FAMILIES, "qwen2_bf16")  # + bf16 weights: written back as bf16 (dtype auto)
# save layout (hf-to-megatron) and load layout (megatron-to-hf), all with 2 processes
LAYOUTS = {
    "qwen3_moe": (["--tp", "2", "--ep", "2"], ["--tp", "1", "--pp", "2"]),
    "qwen2": (["--tp", "2"], ["--tp", "1", "--pp", "2"]),
    "mixtral": (["--tp", "2", "--ep", "2"], ["--tp", "2", "--ep", "2"]),
    "qwen3": (["--tp", "2"], ["--tp", "2"]),
    "qwen2_bf16": (["--tp", "2"], ["--tp", "2"]),
}


def write_tiny_qwen3(out: Path, tokenizer_from: Path) -> Path:
    """A tiny dense Qwen3 (q/k norm, no biases) with the tokenizer of another tiny model
    (megapo.models.tiny writes qwen3_moe, qwen2 and mixtral only)."""
    import transformers

    ref = json.loads((tokenizer_from / "config.json").read_text())
    config = transformers.Qwen3Config(
        vocab_size=ref["vocab_size"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=128, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False, eos_token_id=ref["eos_token_id"], bos_token_id=ref["bos_token_id"],
        pad_token_id=ref["pad_token_id"])
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    for path in tokenizer_from.iterdir():
        if path.name.startswith("tokenizer") or path.name == "chat_template.jinja":
            shutil.copy2(path, out / path.name)
    return out


@pytest.fixture(scope="module")
def sources(tiny_model_factory, tmp_path_factory) -> dict[str, Path]:
    out = {f: tiny_model_factory(f) for f in FAMILIES if f != "qwen3"}
    out["qwen3"] = write_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"), out["qwen2"])
    out["qwen2_bf16"] = _edited_copy(out["qwen2"], tmp_path_factory.mktemp("bf16") / "qwen2_bf16",
                                     lambda c: c.update(dtype="bfloat16"),
                                     tensors=lambda t: {k: v.to(torch.bfloat16) for k, v in t.items()})
    return out


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    convert.add_arguments(parser)
    return parser.parse_args(argv)


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(out.name))


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    code = megapo_main(["convert", *argv])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


# ------------------------------------------------------------------------------- no processes


@pytest.mark.parametrize("family", FAMILIES)
def test_expected_tensor_names_and_shapes_match_transformers(sources, family):
    from megapo.convert.support import check_config, expected_hf_tensors

    folder = sources[family]
    family_obj, spec = check_config(json.loads((folder / "config.json").read_text()), "--hf")
    with safe_open(folder / "model.safetensors", "pt") as f:
        written = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert expected_hf_tensors(family_obj, spec) == written


def _edited_copy(src: Path, dst: Path, edit=None, tensors=None) -> Path:
    dst.mkdir()
    for path in src.iterdir():
        if path.name != "model.safetensors" or tensors is None:
            shutil.copy2(path, dst / path.name)
    if tensors is not None:
        save_file(tensors(load_file(src / "model.safetensors")), dst / "model.safetensors")
    if edit is not None:
        config = json.loads((dst / "config.json").read_text())
        edit(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


REFUSED = [
    ("qwen2", lambda c: c.update(use_sliding_window=True), "sliding-window"),
    ("qwen2", lambda c: c.update(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    ("mixtral", lambda c: c.update(sliding_window=4096), "sliding_window"),
    ("qwen3_moe", lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     "rope"),
    ("qwen3_moe", lambda c: c.update(mlp_only_layers=[1]), "mlp_only"),
    ("qwen3_moe", lambda c: c.update(shared_expert_intermediate_size=64), "not understood"),
    ("qwen2", lambda c: c.update(tie_word_embeddings=True), "tied"),
    ("qwen2", lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    ("qwen3_moe", lambda c: c.update(model_type="qwen2_moe"), "not supported"),
]


@pytest.mark.parametrize("family,edit,message", REFUSED, ids=[m for _, _, m in REFUSED])
def test_refuses_config_it_does_not_implement(tiny_model_factory, tmp_path, capsys, family, edit, message):
    hf = _edited_copy(tiny_model_factory(family), tmp_path / "hf", edit)
    out = tmp_path / "ckpt"
    code, text = run_cli(["hf-to-megatron", "--hf", str(hf), "--out", str(out)], capsys)
    assert code == 2 and "--hf" in text and message in text, text
    assert leftovers(out) == []


def test_refuses_weights_that_do_not_match_the_config(tiny_moe, tmp_path, capsys):
    wrong_width = _edited_copy(tiny_moe, tmp_path / "a", lambda c: c.update(moe_intermediate_size=64))
    code, text = run_cli(["hf-to-megatron", "--hf", str(wrong_width), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "--hf" in text and "experts.0.gate_proj.weight has shape (128, 64)" in text, text

    def drop(t):
        return {k: v for k, v in t.items() if k != "model.layers.1.mlp.experts.3.up_proj.weight"}

    missing = _edited_copy(tiny_moe, tmp_path / "b", tensors=drop)
    code, text = run_cli(["hf-to-megatron", "--hf", str(missing), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "model.layers.1.mlp.experts.3.up_proj.weight" in text and "not in the safetensors" in text

    def add_shared(t):
        return {**t, "model.layers.0.mlp.shared_expert.gate_proj.weight": torch.zeros(8, 64)}

    extra = _edited_copy(tiny_moe, tmp_path / "c", tensors=add_shared)
    code, text = run_cli(["hf-to-megatron", "--hf", str(extra), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "shared_expert" in text and "would be dropped" in text, text
    assert leftovers(tmp_path / "o") == []


def test_refuses_missing_inputs_and_existing_output(tiny_moe, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["hf-to-megatron", "--hf", str(tmp_path / "nope"), "--out", str(tmp_path / "o")], "--hf", "not a folder"),
        (["hf-to-megatron", "--hf", str(empty), "--out", str(tmp_path / "o")], "--hf", "no config.json"),
        (["hf-to-megatron", "--hf", str(tiny_moe), "--out", str(empty)], "--out", "already exists"),
        (["hf-to-megatron", "--hf", str(tiny_moe), "--out", str(tmp_path / "x" / "o")], "--out", "does not exist"),
        (["megapo-to-hf-typo"], None, None),
        (["megatron-to-hf", "--ckpt", str(tiny_moe), "--out", str(tmp_path / "o")], "--ckpt",
         "not a Megatron torch_dist checkpoint"),
    ]
    weights_only = _edited_copy(tiny_moe, tmp_path / "w", tensors=lambda t: t)
    (weights_only / "config.json").unlink()
    cases.append((["hf-to-megatron", "--hf", str(weights_only), "--out", str(tmp_path / "o")], "--hf",
                  "no config.json"))
    for argv, flag, message in cases:
        if flag is None:
            with pytest.raises(SystemExit):
                megapo_main(["convert", *argv])
            capsys.readouterr()
            continue
        code, text = run_cli(argv, capsys)
        assert code == 2 and flag in text and message in text, (argv, text)
    assert leftovers(tmp_path / "o") == []


@pytest.mark.parametrize("family,layout,flag,message", [
    ("qwen3_moe", ["--tp", "3"], "--tp", "does not divide num_attention_heads=4"),
    ("qwen3_moe", ["--pp", "3"], "--pp", "does not divide num_hidden_layers=2"),
    ("qwen3_moe", ["--tp", "2", "--ep", "3"], "--ep", "must divide"),
    ("qwen3_moe", ["--tp", "2", "--ep", "2", "--pp", "2", "--dp", "2"], "--tp/--pp/--dp", "needs 8 processes"),
    ("qwen2", ["--tp", "2", "--ep", "2"], "--ep", "dense"),
    ("qwen2", ["--tp", "0"], "--tp", ">= 1"),
])
def test_refuses_layouts_before_starting_processes(tiny_model_factory, tmp_path, capsys, monkeypatch, family,
                                                   layout, flag, message):
    monkeypatch.setattr(convert, "max_local_processes", lambda: 4)
    out = tmp_path / "o"
    code, text = run_cli(["hf-to-megatron", "--hf", str(tiny_model_factory(family)), "--out", str(out), *layout],
                         capsys)
    assert code == 2 and flag in text and message in text, text
    assert leftovers(out) == []


def test_parse_size():
    from megapo.convert.hf_writer import parse_size

    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("1.5 kb") == 1500
    assert parse_size("4G") == 4 * 10**9
    assert parse_size("123") == 123
    for bad in ("", "GB", "5 parsecs", "0", "-1MB"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_shard_writer_splits_by_size_and_indexes(tmp_path):
    from megapo.convert.hf_writer import INDEX, ShardWriter

    gen = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(10 * (i + 1), 7, generator=gen) for i in range(6)}  # 280..1680 bytes in fp32
    limit = 2000
    writer = ShardWriter(tmp_path, max_shard_bytes=limit, dtype=torch.bfloat16)
    for name, t in tensors.items():
        writer.add(name, t)
        assert writer._pending_bytes <= limit  # holds at most one shard
    files = writer.close()
    index = json.loads((tmp_path / INDEX).read_text())
    # the expected grouping, written out: fill a shard until the next tensor would pass the limit
    sizes = [t.numel() * 2 for t in tensors.values()]
    groups, current, total = [], [], 0
    for name, size in zip(tensors, sizes):
        if current and total + size > limit:
            groups.append(current)
            current, total = [], 0
        current.append(name)
        total += size
    groups.append(current)
    assert len(files) == len(groups) > 1
    assert index["metadata"]["total_size"] == sum(sizes)
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        assert all(index["weight_map"][n] == fname for n in names)
        loaded = load_file(tmp_path / fname)
        assert sorted(loaded) == sorted(names)
        for n in names:
            assert torch.equal(loaded[n], tensors[n].to(torch.bfloat16))
    assert not list(tmp_path.glob("*.partial"))
    with pytest.raises(ValueError, match="written twice"):
        again = ShardWriter(tmp_path / "x", 10**6, torch.float32)
        again.add("a", torch.zeros(1))
        again.add("a", torch.zeros(1))


# ------------------------------------------------------------------------------- conversions


def _plans(argvs: list[list[str]], scratch: Path) -> list:
    planners = {"hf-to-megatron": convert.plan_hf_to_megatron, "megatron-to-hf": convert.plan_megatron_to_hf,
                "verify": convert.plan_verify}
    plans = []
    for argv in argvs:
        args = parse(argv)
        plans.append(planners[args.direction](args, scratch))
    return plans


@pytest.fixture(scope="module")
def conversions(sources, tmp_path_factory):
    """Launch 1: hf-to-megatron of each family (+ --verify) and the trainer checkpoint; launch 2:
    megatron-to-hf of each (+ --verify) and of the trainer checkpoint, and a verify of an HF config whose
    router normalisation was flipped against the unchanged checkpoint. Returns paths, exit codes, output."""
    from megapo.launch.local import run_torchrun

    root = tmp_path_factory.mktemp("convert")
    src = sources
    ckpt = {f: root / f"{f}_ckpt" for f in CASES}
    hf = {f: root / f"{f}_hf" for f in CASES}
    scratch = root / "scratch"
    scratch.mkdir()
    capture = {}

    rc = run_torchrun([str(Path(__file__).parent / "distributed" / "convert_train_ckpt.py"),
                       "--model", str(src["qwen3_moe"]), "--root", str(root / "run"),
                       "--weights", str(root / "trained.pt"), "--tp", "2"], nproc=2, timeout_s=600)
    assert rc == 0

    plans = _plans([["hf-to-megatron", "--hf", str(src[f]), "--out", str(ckpt[f]), "--verify", *LAYOUTS[f][0]]
                    for f in CASES], scratch)
    capture["h2m"] = convert.run_plans(plans, timeout_s=600)

    flipped = _edited_copy(src["qwen3_moe"], root / "flipped_hf", lambda c: c.update(norm_topk_prob=False))
    argvs = [["megatron-to-hf", "--ckpt", str(ckpt[f]), "--out", str(hf[f]), "--verify", *LAYOUTS[f][1]]
             for f in CASES]
    argvs[0] += ["--max-shard-size", "400KB"]  # several shards + index for one family
    argvs.append(["megatron-to-hf", "--ckpt", str(root / "run" / "step_00000001"), "--model", str(src["qwen3_moe"]),
                  "--out", str(root / "trained_hf"), "--verify", "--tp", "1", "--pp", "2"])
    argvs.append(["verify", "--hf", str(flipped), "--ckpt", str(ckpt["qwen3_moe"]), "--tp", "2", "--ep", "2"])
    plans = _plans(argvs, scratch)
    capture["m2h"] = convert.run_plans(plans, timeout_s=600)
    return {"src": src, "ckpt": ckpt, "hf": hf, "root": root, "codes": capture, "flipped": flipped}


def test_hf_to_megatron_to_hf_round_trips_bit_exactly(conversions, capsys):
    assert conversions["codes"]["h2m"] == [0] * len(CASES)
    assert conversions["codes"]["m2h"][:len(CASES) + 1] == [0] * (len(CASES) + 1)
    for family in CASES:
        ckpt = conversions["ckpt"][family]
        meta = json.loads((ckpt / "megapo_checkpoint.json").read_text())
        source_config = json.loads((conversions["src"][family] / "config.json").read_text())
        assert meta["family"] == source_config["model_type"]
        assert meta["source"]["dtype"] == ("bfloat16" if family.endswith("bf16") else "float32")
        print(family, "hf-to-megatron verify:", meta["verify"])
        assert meta["verify"]["max_logprob_diff"] < 1e-4 and meta["verify"]["max_entropy_diff"] < 1e-4
        assert (ckpt / "tokenizer.json").is_file() and (ckpt / "config.json").is_file()
        source = read_all(conversions["src"][family])
        back = read_all(conversions["hf"][family])
        assert sorted(back) == sorted(source)
        for name, tensor in source.items():
            assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), (family, name)
    sharded = conversions["hf"]["qwen3_moe"]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (sharded / "model.safetensors").exists()


def test_converted_folder_loads_offline_in_transformers(conversions):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for family in CASES:
        out = conversions["hf"][family]
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
        ref = AutoModelForCausalLM.from_pretrained(conversions["src"][family], dtype=torch.float32)
        ids = torch.tensor([[5, 17, 300, 42, 9, 250, 3]])
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
        tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
        assert tok("1 + 2").input_ids == AutoTokenizer.from_pretrained(conversions["src"][family])("1 + 2").input_ids


def test_flipped_router_normalisation_fails_verify_although_tensors_match(conversions):
    # the flipped folder holds the same tensors as the source (which round-trips exactly, above) ...
    assert read_all(conversions["flipped"]).keys() == read_all(conversions["src"]["qwen3_moe"]).keys()
    # ... but routes without renormalising the top-k weights: the learner (checkpoint config) disagrees
    assert conversions["codes"]["m2h"][-1] == 1


def test_trainer_checkpoint_converts_and_generates(conversions):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert conversions["codes"]["m2h"][len(CASES)] == 0  # includes --verify against the learner
    out = conversions["root"] / "trained_hf"
    trained = torch.load(conversions["root"] / "trained.pt")
    got = read_all(out)
    source = read_all(conversions["src"]["qwen3_moe"])
    assert sorted(got) == sorted(trained)
    assert all(torch.equal(got[k], trained[k]) for k in trained)
    assert any(not torch.equal(got[k], source[k]) for k in source)  # the step changed the weights
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    prompt = tok("the sum of 1 and 2 is", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    new = generated[0, prompt.input_ids.shape[1]:]
    assert new.numel() == 6
    # greedy: each generated token is the argmax of the model's logits on the text so far
    with torch.no_grad():
        logits = model(input_ids=generated[:, :-1]).logits[0, prompt.input_ids.shape[1] - 1:]
    assert torch.equal(logits.argmax(-1), new)


def test_checkpoint_side_errors(conversions, tmp_path, capsys):
    trainer_ckpt = conversions["root"] / "run" / "step_00000001"
    code, text = run_cli(["megatron-to-hf", "--ckpt", str(trainer_ckpt), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "--model" in text and "no config.json" in text, text
    code, text = run_cli(["megatron-to-hf", "--ckpt", str(trainer_ckpt), "--model", str(conversions["src"]["qwen2"]),
                          "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "--ckpt" in text and "lacks" in text and "linear_fc1.weight" in text, text
    narrow = _edited_copy(conversions["src"]["qwen3_moe"], tmp_path / "narrow",
                          lambda c: c.update(moe_intermediate_size=64))
    code, text = run_cli(["megatron-to-hf", "--ckpt", str(trainer_ckpt), "--model", str(narrow),
                          "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "linear_fc1.weight has shape (2, 8, 256, 64)" in text, text
    code, text = run_cli(["megatron-to-hf", "--ckpt", str(conversions["ckpt"]["qwen2"]), "--out",
                          str(tmp_path / "o"), "--max-shard-size", "lots"], capsys)
    assert code == 2 and "--max-shard-size" in text
    assert leftovers(tmp_path / "o") == []


def test_failure_midway_leaves_nothing_that_looks_like_a_checkpoint(conversions, tmp_path, capsys):
    out = tmp_path / "hf_out"
    code = megapo_main(["convert", "megatron-to-hf", "--ckpt", str(conversions["ckpt"]["qwen2"]), "--out", str(out),
                        "--tp", "2", "--max-shard-size", "100KB", "--inject-failure", "after_shards:2"])
    text = capsys.readouterr().err
    assert code == 1 and "nothing was written" in text, text
    assert leftovers(out) == []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
