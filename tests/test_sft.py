"""SFT warm start: reaches the validation threshold and generalises to the held-out test split,
measured by a hand-written greedy decode (no KV cache, no generate()) and arithmetic on the prompt text."""

import json

import torch

from megapo.trainer.config import SFTConfig


def _manual_greedy_accuracy(model_dir, n):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megapo.tasks import addition

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    exs = addition.examples("test", n)
    ids = torch.tensor([tok(e.prompt, add_special_tokens=False)["input_ids"] for e in exs])
    with torch.no_grad():
        for _ in range(5):  # 4 digits + end-of-sequence
            nxt = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    correct = 0
    for e, row in zip(exs, ids[:, 8:].tolist()):
        a, b = int(e.prompt[:3]), int(e.prompt[4:7])
        want = tok(f"{a + b:04d}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        correct += row == want
    return correct / n


def test_sft_reaches_threshold_and_beats_chance(tmp_path, tiny_moe):
    from megapo.trainer.eval import evaluate
    from megapo.trainer.sft import train_sft

    out = tmp_path / "sft"
    # validation exact-match of the default run, checked every 20 steps (2026-12-07): 0.006 at 20, 0.014 at 140,
    # 0.046 at 160, 0.116 at 180 (0.136 in another run), 0.156 at 200, 0.394 at 220. A threshold of 0.1 (100x the
    # ~1e-3 chance of a guessed 4-digit sum) checked every 60 steps stops at 180 with 3 validations of 500 prompts
    # instead of 11 up to 220 (its test-split accuracy below was 0.137)
    result = train_sft(tiny_moe, out, SFTConfig(enabled=True, threshold=0.1, check_every=60, max_steps=600))
    assert result.reached and result.val_accuracy >= 0.1
    assert result.history[-1]["step"] == result.steps and result.steps % 60 == 0
    assert json.loads((out / "sft_result.json").read_text())["reached"]
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    manual = _manual_greedy_accuracy(out, 300)
    assert manual > 0.05  # chance of guessing a 4-digit sum is ~1e-3 at best
    helper = evaluate(str(out), split="test", n=300)
    assert abs(helper.accuracy - manual) <= 2 / 300  # cached generate() vs plain argmax: same decisions
    from transformers import AutoTokenizer

    from megapo.engines.embedded import EmbeddedEngine

    via_engine = evaluate(EmbeddedEngine(out), split="test", n=300, tokenizer=AutoTokenizer.from_pretrained(out))
    assert abs(via_engine.accuracy - manual) <= 2 / 300
    base = evaluate(str(tiny_moe), split="test", n=300)
    assert base.accuracy < 0.01 < helper.accuracy


def test_sft_cli_refuses_bad_args(tmp_path, capsys):
    from megapo.cli import main

    # the one error surface (megapo.cli): exit 2, "megapo sft: <field>: ...", nothing written
    assert main(["sft", "--model", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.startswith("megapo sft: --model: ")
    assert main(["sft", "--model", str(tmp_path), "--out", str(tmp_path / "o"), "--threshold", "0"]) == 2
    assert capsys.readouterr().err.startswith("megapo sft: --threshold: ")
    for flag, value, message in (("--lr", "nan", "must be a finite number, got nan"), ("--lr", "0", "must be > 0"),
                                 ("--batch-size", "0", "must be >= 1, got 0")):  # SFTConfig's declared ranges
        assert main(["sft", "--model", str(tmp_path), "--out", str(tmp_path / "o"), flag, value]) == 2
        assert capsys.readouterr().err.startswith(f"megapo sft: {flag}: {message}")
    assert not (tmp_path / "o").exists()
