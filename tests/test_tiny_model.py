"""`megapo tiny-model` writes a folder that transformers loads offline and generates from."""

import json
import subprocess
import sys

import pytest
import torch


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2", "mixtral"])
def test_cli_output_loads_offline_and_generates(tmp_path, family):
    import transformers

    out = tmp_path / family
    cmd = [sys.executable, "-m", "megapo.cli", "tiny-model", "--out", str(out), "--family", family,
           "--layers", "3", "--experts", "4", "--topk", "2", "--hidden", "64", "--vocab", "400", "--seed", "7"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": ""})
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family
    assert config["num_hidden_layers"] == 3 and config["vocab_size"] == 400
    if family != "qwen2":
        assert config["num_experts_per_tok"] == 2
        assert config.get("num_experts", config.get("num_local_experts")) == 4

    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert len(tok) <= config["vocab_size"]
    # digits are one token each (arithmetic tasks rely on it) and text round-trips through the tokenizer
    ids = tok("123+456=").input_ids
    assert [tok.decode([i]) for i in ids[:3]] == ["1", "2", "3"]
    assert tok.decode(ids) == "123+456="
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>assistant\n")

    prompt = torch.tensor([ids])
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert generated.shape[1] > prompt.shape[1]
    assert torch.equal(generated[0, : prompt.shape[1]], prompt[0])


def test_same_seed_same_weights_other_seed_differs(tmp_path):
    from safetensors.torch import load_file

    from megapo.models.tiny import write_tiny_model

    a = load_file(write_tiny_model(tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(write_tiny_model(tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(write_tiny_model(tmp_path / "c", seed=4) / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("kwargs, word", [({"family": "gpt9"}, "--family"), ({"topk": 9, "experts": 8}, "--topk"),
                                          ({"vocab": 100}, "--vocab")])
def test_bad_arguments_name_the_flag(tmp_path, kwargs, word):
    from megapo.models.tiny import write_tiny_model

    with pytest.raises(ValueError, match=word):
        write_tiny_model(tmp_path / "m", **kwargs)
    assert not (tmp_path / "m").exists()
