"""On-policy distillation (megapo/trainer/distill.py): the reverse-KL advantage against the formula written out,
the config's refusals, and a megapo train run whose teacher is the student's own weights (reverse KL exactly 0)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from megapo.config import ConfigError
from megapo.trainer.distill import DistillConfig, reverse_kl_advantages

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from train_runs import train_rows  # noqa: E402


def test_reverse_kl_advantage_is_the_formula_written_out():
    adv = [0.5, [1.0, -1.0, 2.0]]
    old = [[-1.0, -2.0], [-0.5, -0.25, -3.0]]
    teacher = [[-1.5, -1.0], [-0.5, -1.25, -2.0]]
    mask = [None, [1, 0, 1]]
    got, kl = reverse_kl_advantages(adv, old, teacher, 0.1, mask)
    # A_t - β (old_t - teacher_t), token by token
    assert got[0] == pytest.approx([0.5 - 0.1 * 0.5, 0.5 - 0.1 * -1.0])
    assert got[1] == pytest.approx([1.0 - 0.1 * 0.0, -1.0 - 0.1 * 1.0, 2.0 - 0.1 * -1.0])
    # the mean gap over the policy tokens: (0.5 - 1.0 + 0.0 - 1.0) / 4; the masked token (gap 1.0) left out
    assert kl == pytest.approx((0.5 - 1.0 + 0.0 - 1.0) / 4)
    with pytest.raises(ValueError, match=r"teacher_logp\[0\]"):
        reverse_kl_advantages([0.0], [[-1.0, -1.0]], [[-1.0]], 1.0)


def test_teacher_refusals_name_the_field(tmp_path, tiny_moe, tiny_dense):
    with pytest.raises(ConfigError) as err:
        DistillConfig(teacher=str(tmp_path / "none")).validate(str(tiny_moe))
    assert err.value.field == "algorithm.distill.teacher" and "no config.json" in str(err.value)
    with pytest.raises(ConfigError) as err:
        DistillConfig(teacher=str(tiny_moe), mode="topk_forward_kl").validate(str(tiny_moe))
    assert err.value.field == "algorithm.distill.mode"
    other = tmp_path / "other_tokenizer"
    shutil.copytree(tiny_moe, other)
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text().replace('"<', '"<x', 1))
    with pytest.raises(ConfigError) as err:
        DistillConfig(teacher=str(other)).validate(str(tiny_moe))
    assert err.value.field == "algorithm.distill.teacher" and "tokenizer.json differs" in str(err.value)
    bigger = tmp_path / "bigger_vocab"
    shutil.copytree(tiny_moe, bigger)
    config = json.loads((bigger / "config.json").read_text())
    (bigger / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 64}))
    with pytest.raises(ConfigError) as err:
        DistillConfig(teacher=str(bigger)).validate(str(tiny_moe))
    assert "vocab_size" in str(err.value)
    DistillConfig(teacher=str(tiny_moe)).validate(str(tiny_moe))  # the student itself is a valid teacher


# ----------------------------------------------------------------------------- megapo train with a teacher

def distill_rows(tmp_path, student, teacher, name: str) -> list[dict]:
    return train_rows(tmp_path, name, f"model.path={student}", f"algorithm.distill.teacher={teacher}",
                      "algorithm.distill.coef=0.5", "algorithm.routing_replay=r3", "train.steps=1",
                      "data.prompts_per_step=8", "rollout.n_samples=4")


def test_teacher_equal_to_the_student_gives_exactly_zero_reverse_kl_and_another_does_not(tmp_path, tiny_moe):
    """The teacher is a second Megatron model of the student's weights replaying the same routes: its log-probs are
    the old-log-prob pass's to the bit, so distill/reverse_kl is 0.0 at step 1. A teacher of other weights (same
    shape and tokenizer) gives a non-zero reverse KL and the step still trains."""
    from family_checks import write_variant

    same = distill_rows(tmp_path, tiny_moe, tiny_moe, "same")
    assert same[0]["step"] == 1 and same[0]["distill/reverse_kl"] == 0.0
    other = write_variant(Path(tiny_moe), tmp_path / "other_teacher", seed=7)
    rows = distill_rows(tmp_path, tiny_moe, other, "other")
    assert rows[0]["distill/reverse_kl"] != 0.0 and rows[0]["train/skipped_nonfinite"] == 0
    assert rows[0]["train/loss"] == rows[0]["train/loss"]  # finite
