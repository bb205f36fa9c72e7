"""On-policy distillation (megapo/trainer/distill.py): the reverse-KL advantage against the formula written out, with
one teacher and with several (a loop over hand-made log-probs), the config's refusals, and megapo train runs whose
teacher (or first of two) is the student's own weights (reverse KL exactly 0)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from megapo.algorithms.config import TeacherConfig
from megapo.config import ConfigError, from_dict
from megapo.trainer.distill import DistillConfig, reverse_kl_advantages, reverse_kl_metrics, teachers_advantages

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


def test_several_teachers_subtract_each_weighted_reverse_kl():
    """A_t - Σ_j β_j (old_t - T_j,t), written out as a loop over samples, tokens and teachers; each teacher's mean
    gap over the policy tokens."""
    adv = [0.25, [1.0, -1.0, 2.0]]
    old = [[-1.0, -2.0], [-0.5, -0.25, -3.0]]
    teachers = [[[-1.5, -1.0], [-0.5, -1.25, -2.0]],  # teacher 0
                [[-0.75, -2.5], [-1.0, -0.5, -4.0]]]  # teacher 1
    coefs = [0.1, 0.3]
    mask = [None, [1, 0, 1]]
    got, kls = teachers_advantages(adv, old, teachers, coefs, mask)
    want = []
    for i, old_i in enumerate(old):
        row = []
        for t, old_t in enumerate(old_i):
            a = adv[i] if not isinstance(adv[i], list) else adv[i][t]
            for coef, teacher in zip(coefs, teachers):
                a -= coef * (old_t - teacher[i][t])
            row.append(a)
        want.append(row)
    assert len(got) == 2 and all(g == pytest.approx(w, abs=1e-12) for g, w in zip(got, want))
    # teacher 0's gaps on the policy tokens 0.5, -1.0 | 0.0, (masked), -1.0; teacher 1's -0.25, 0.5 | 0.5, 1.0
    assert kls == pytest.approx([(0.5 - 1.0 + 0.0 - 1.0) / 4, (-0.25 + 0.5 + 0.5 + 1.0) / 4])
    # one teacher through the list is the single-teacher formula
    single, kl = reverse_kl_advantages(adv, old, teachers[0], 0.1, mask)
    assert teachers_advantages(adv, old, teachers[:1], [0.1], mask) == (single, [kl])


def test_reverse_kl_metrics_keep_the_single_teacher_name():
    assert reverse_kl_metrics([0.5]) == {"distill/reverse_kl": 0.5}
    assert reverse_kl_metrics([0.0, 0.5]) == {"distill/reverse_kl": 0.0, "distill/reverse_kl/0": 0.0,
                                              "distill/reverse_kl/1": 0.5}


def test_teacher_and_coef_are_one_entry_of_teachers():
    one = DistillConfig(teacher="/t", coef=0.25)
    assert one.enabled and one.all_teachers() == [TeacherConfig("/t", 0.25)]
    assert one.path_fields() == ["algorithm.distill.teacher"]
    several = from_dict(DistillConfig, {"teachers": [{"path": "/a", "coef": 0.5}, {"path": "/b"}]}, "algorithm.distill")
    assert several.all_teachers() == [TeacherConfig("/a", 0.5), TeacherConfig("/b", 1.0)]
    assert several.path_fields() == ["algorithm.distill.teachers[0].path", "algorithm.distill.teachers[1].path"]
    assert not DistillConfig().enabled and DistillConfig().all_teachers() == []


def test_config_show_writes_the_teachers_as_yaml_entries():
    from megapo.commands.config import show_lines
    from megapo.config import field_docs
    from megapo.trainer.config import RunConfig

    cfg = from_dict(RunConfig, {"algorithm": {"distill": {"teachers": [{"path": "/a", "coef": 0.5}, {"path": "/b"}]}}})
    lines = show_lines(cfg)
    assert any(line.startswith("algorithm.distill.teachers = [{coef: 0.5, path: /a}, {coef: 1.0, path: /b}]")
               for line in lines)
    assert all(field_docs(TeacherConfig).values())  # each entry's fields are documented where declared


def test_several_teachers_refusals_name_the_field(tmp_path, tiny_moe):
    def refused(**fields) -> ConfigError:
        with pytest.raises(ConfigError) as err:
            DistillConfig(**fields).validate(str(tiny_moe))
        return err.value

    err = refused(teachers=[TeacherConfig(str(tiny_moe)), TeacherConfig(str(tmp_path / "none"))])
    assert err.field == "algorithm.distill.teachers[1].path" and "no config.json" in str(err)
    other = tmp_path / "other_tokenizer"
    shutil.copytree(tiny_moe, other)
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text().replace('"<', '"<x', 1))
    err = refused(teachers=[TeacherConfig(str(other), 0.5), TeacherConfig(str(tiny_moe), 0.5)])
    assert err.field == "algorithm.distill.teachers[0].path" and "tokenizer.json differs" in str(err)
    err = refused(teacher=str(tiny_moe), teachers=[TeacherConfig(str(tiny_moe))])
    assert err.field == "algorithm.distill.teachers" and "not both" in str(err)
    err = refused(coef=0.5, teachers=[TeacherConfig(str(tiny_moe))])
    assert err.field == "algorithm.distill.coef"
    err = refused(teachers=[TeacherConfig(str(tiny_moe)), TeacherConfig("")])
    assert err.field == "algorithm.distill.teachers[1].path"
    err = refused(teachers=[TeacherConfig(str(tiny_moe), -1.0)])  # built in Python: the range still holds
    assert err.field == "algorithm.distill.teachers[0].coef"
    with pytest.raises(ConfigError) as raised:  # the loader names the entry's field too
        from_dict(DistillConfig, {"teachers": [{"path": str(tiny_moe)}, {"pth": str(tiny_moe)}]}, "algorithm.distill")
    assert raised.value.field == "algorithm.distill.teachers[1].pth"
    DistillConfig(teachers=[TeacherConfig(str(tiny_moe), 0.5), TeacherConfig(str(tiny_moe), 0.5)]).validate(
        str(tiny_moe))


def test_a_teacher_saved_by_transformers_keeps_the_students_tokenizer(tmp_path, tiny_moe):
    """A teacher whose tokenizer was loaded from the student's folder and saved again (as `megapo sft` does:
    tokenizer_config.json gains load-time keys) is the student's tokenizer; a changed special token is not."""
    from transformers import AutoTokenizer

    saved = tmp_path / "saved"
    shutil.copytree(tiny_moe, saved)
    AutoTokenizer.from_pretrained(tiny_moe).save_pretrained(saved)
    DistillConfig(teacher=str(saved)).validate(str(tiny_moe))
    changed = tmp_path / "changed"
    shutil.copytree(tiny_moe, changed)
    tc = json.loads((changed / "tokenizer_config.json").read_text())
    tc["eos_token"] = "<not-the-students>"
    (changed / "tokenizer_config.json").write_text(json.dumps(tc))
    with pytest.raises(ConfigError) as err:
        DistillConfig(teacher=str(changed)).validate(str(tiny_moe))
    assert "tokenizer_config.json differs" in str(err.value)


def test_teacher_refusals_name_the_field(tmp_path, tiny_moe, tiny_dense):
    with pytest.raises(ConfigError) as err:
        DistillConfig(teacher=str(tmp_path / "none")).validate(str(tiny_moe))
    assert err.value.field == "algorithm.distill.teacher" and "no config.json" in str(err.value)
    with pytest.raises(ConfigError) as err:
        DistillConfig(teacher=str(tiny_moe), mode="forward_kl").validate(str(tiny_moe))
    assert err.value.field == "algorithm.distill.mode"  # (topk_forward_kl is built: tests/test_topk_distill.py)
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


def test_two_teachers_one_the_student_gives_zero_reverse_kl_for_it(tmp_path, tiny_moe):
    """teachers: [the student's own folder, other weights]: teacher 0's reverse KL is exactly 0 at step 1 (the same
    forward on the same routes as the old-log-prob pass), teacher 1's is not, and distill/reverse_kl is teacher 0's."""
    from family_checks import write_variant

    other = write_variant(Path(tiny_moe), tmp_path / "other_teacher", seed=7)
    rows = train_rows(tmp_path, "two", f"model.path={tiny_moe}", "algorithm.routing_replay=r3", "train.steps=1",
                      f"algorithm.distill.teachers=[{{path: {tiny_moe}, coef: 0.5}}, {{path: {other}, coef: 0.25}}]",
                      "data.prompts_per_step=8", "rollout.n_samples=4")
    row = rows[0]
    assert row["distill/reverse_kl/0"] == 0.0 and row["distill/reverse_kl"] == 0.0
    assert row["distill/reverse_kl/1"] != 0.0 and row["train/skipped_nonfinite"] == 0
