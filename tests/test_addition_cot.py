"""addition_cot: splits, difficulty, the two response formats, the final-answer verifier, the warm start's mix,
the tiny tokenizer and the shipped config."""

import random
import re
from pathlib import Path

import pytest

from megapo.tasks import addition_cot as cot
from megapo.tasks.registry import get_task

REPO = Path(__file__).resolve().parents[1]
COLUMN = re.compile(r"^(\d)\+(\d)\+([01])=(\d)(\d)$")


def _check_scratchpad(text: str, a: int, b: int) -> None:
    """The scratchpad read back column by column: digits of a and b from the right, the carry in is the
    previous column's carry out, carry out and digit are the column's sum; the last field is a + b."""
    *columns, final = text.split(";")
    da, db = str(a)[::-1], str(b)[::-1]
    assert len(columns) == len(da) == len(db)
    carry = 0
    for k, col in enumerate(columns):
        x, y, c, hi, lo = map(int, COLUMN.match(col).groups())
        assert (x, y, c) == (int(da[k]), int(db[k]), carry)
        assert 10 * hi + lo == x + y + c
        carry = hi
    assert final == str(a + b)


def test_scratchpad_is_the_column_addition():
    rng = random.Random(3)
    for digits in range(1, 10):
        for _ in range(30):
            a, b = (rng.randint(10 ** (digits - 1), 10 ** digits - 1) for _ in range(2))
            _check_scratchpad(cot.scratchpad(a, b), a, b)
    assert cot.scratchpad(47, 85) == "7+5+0=12;4+8+1=13;132"  # the docstring's example


def test_reward_reads_the_final_answer_only():
    assert cot.reward("132", "132") == 1.0 and cot.reward(" 132 ", "132") == 1.0
    assert cot.reward("7+5+0=12;4+8+1=13;132", "132") == 1.0
    assert cot.reward("wrong columns;132", "132") == 1.0  # only the final answer counts
    assert cot.reward("7+5+0=12;4+8+1=13;133", "132") == 0.0
    assert cot.reward("7+5+0=12;4+8+1=13;", "132") == 0.0 and cot.reward("", "132") == 0.0
    assert cot.reward("0132", "132") == 0.0 and cot.reward("132;", "132") == 0.0



def test_graded_first_reads_the_first_written_sum_so_the_check_cannot_change_it():
    checked = "7+5+0=12;4+8+1=13;132;7+5+0=12;4+8+1=13;132"
    slipped = "7+5+0=12;4+8+1=13;132;7+5+0=12;4+8+1=14;142"  # a slip in the check's second pass
    early = "7+5+0=12;4+8+1=13;133;7+5+0=12;4+8+1=13;132"  # wrong first, "fixed" by the check
    first, last = (get_task("addition_cot", {"graded": g}).reward for g in ("first", "last"))
    assert (first, last) == ("megapo.tasks.addition_cot:reward_first", "megapo.tasks.addition_cot:reward")
    assert [cot.reward_first(r, "132") for r in (checked, slipped, early)] == [1.0, 1.0, 0.0]
    assert [cot.reward(r, "132") for r in (checked, slipped, early)] == [1.0, 0.0, 1.0]
    assert cot.reward_first("132", "132") == 1.0 and cot.reward_first(" 132 ", "132") == 1.0
    assert cot.reward_first("7+5+0=12;4+8+1=13", "132") == 0.0 and cot.reward_first("", "132") == 0.0
    assert cot.reward_first("7+5+0=12;4+8+1=13;;132", "132") == 0.0  # an empty part is the first sum
    with pytest.raises(ValueError, match="graded"):
        get_task("addition_cot", {"graded": "middle"})

def test_splits_are_disjoint_balanced_and_bucketed_by_digits():
    task = get_task("addition_cot")
    assert task.sizes["test"] == 1000 and task.sizes["validation"] == 500
    test, val = task.examples("test"), task.examples("validation")
    train = task.examples("train", 5000, seed=1)
    key = lambda e: (e.meta["a"], e.meta["b"])  # noqa: E731
    assert len({key(e) for e in test}) == 1000 and len({key(e) for e in val}) == 500
    assert not {key(e) for e in test} & {key(e) for e in val}
    assert not {key(e) for e in train} & ({key(e) for e in test} | {key(e) for e in val})
    for split, exs in (("test", test), ("validation", val), ("train", train)):
        for e in exs:
            a, b = key(e)
            assert e.prompt == f"{a}+{b}=" and e.answer == str(a + b)
            assert e.difficulty == len(str(a)) == len(str(b)) and 2 <= e.difficulty <= 6
            assert cot.split_of(a, b) == split
    assert [sum(e.difficulty == d for e in test) for d in range(2, 7)] == [200] * 5
    assert [e.difficulty for e in task.examples("test", 10)] == [2, 3, 4, 5, 6] * 2  # the first n are balanced
    narrow = get_task("addition_cot", {"min_digits": 4, "max_digits": 5})
    assert {e.difficulty for e in narrow.examples("train", 50, seed=0)} == {4, 5}
    # a digit count's held-out problems do not depend on the range asked for
    assert [key(e) for e in narrow.examples("test") if e.difficulty == 4] == [key(e) for e in test if e.difficulty == 4]


@pytest.mark.parametrize("frac", [0.0, 0.3, 1.0])
def test_warm_start_mixes_both_formats(frac):
    pairs = get_task("addition_cot", {"scratchpad_frac": frac}).sft_pairs(2000, seed=0)
    verbose = 0
    for ex, target in pairs:
        a, b = ex.meta["a"], ex.meta["b"]
        if ";" in target:
            _check_scratchpad(target, a, b)
            verbose += 1
        else:
            assert target == ex.answer == str(a + b)
    assert abs(verbose / 2000 - frac) < 0.04  # binomial sd at 0.3: ~0.01


def test_checked_demonstrations_do_the_columns_twice():
    pairs = get_task("addition_cot", {"scratchpad_frac": 0.6, "check_frac": 0.75}).sft_pairs(2000, seed=0)
    counts = {"terse": 0, "scratchpad": 0, "checked": 0}
    for ex, target in pairs:
        a, b = ex.meta["a"], ex.meta["b"]
        passes = target.split(";" + str(a + b) + ";")  # a checked target: one pass, the sum, the same pass again
        if len(passes) == 2:
            assert passes[0] + ";" + str(a + b) == passes[1]
            _check_scratchpad(passes[1], a, b)
            kind = "checked"
        else:
            kind = "scratchpad" if ";" in target else "terse"
        assert cot.response_format(target) == kind and cot.reward(target, ex.answer) == 1.0
        counts[kind] += 1
    assert abs(counts["checked"] / 2000 - 0.6 * 0.75) < 0.04
    assert abs((counts["checked"] + counts["scratchpad"]) / 2000 - 0.6) < 0.04
    # the scratchpad share is drawn as without checks: a config's warm start keeps its mix
    plain = get_task("addition_cot", {"scratchpad_frac": 0.6}).sft_pairs(2000, seed=0)
    assert [";" in t for _, t in plain] == [";" in t for _, t in pairs]
    with pytest.raises(ValueError, match="check_frac"):
        get_task("addition_cot", {"check_frac": 1.5})


def test_tiny_tokenizer_writes_the_scratchpad_and_the_config_fits_it(tiny_moe, tmp_path):
    from transformers import AutoTokenizer

    from megapo.config import load_config
    from megapo.trainer.config import RunConfig
    from megapo.trainer.data import encode_answer, encode_prompt

    tok = AutoTokenizer.from_pretrained(tiny_moe)
    a, b = 987654, 123456
    text = cot.scratchpad(a, b)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and tok.unk_token_id not in ids
    assert len(ids) == len(text)  # one token per character: 9 per column, as the docstring counts
    cfg = load_config(RunConfig, REPO / "megapo/configs/tiny_moe_addition_cot.yaml",
                      [f"model.path={tiny_moe}", f"train.output_dir={tmp_path / 'run'}"])
    assert cfg.data.task == "addition_cot" and cfg.sft.enabled
    hi = get_task(cfg.data.task, cfg.data.task_options)
    longest = cot.scratchpad(10 ** hi_digits(cfg) - 1, 10 ** hi_digits(cfg) - 1)
    assert len(encode_answer(tok, longest)) <= cfg.rollout.max_new_tokens  # the longest scratchpad + EOS fits
    widest = max(len(encode_prompt(tok, e.prompt, cfg.data.chat_template)) for e in hi.examples("test"))
    assert widest <= cfg.data.max_prompt_tokens


def hi_digits(cfg) -> int:
    return cfg.data.task_options.get("max_digits", cot.MAX_DIGITS)
