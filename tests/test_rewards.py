"""Reward functions against hand-made cases."""

import sys

import pytest

from megapo.config import ConfigError
from megapo.trainer import rewards


def test_exact_match():
    assert rewards.exact_match("0579", "0579") == 1.0
    assert rewards.exact_match(" 0579 ", "0579") == 1.0
    assert rewards.exact_match("579", "0579") == 0.0


@pytest.mark.parametrize("response,answer,expected", [
    ("so the answer is \\boxed{42}", "42", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("the result is 1/2.", "\\frac{1}{2}", 1.0),
    ("we get 1,000 apples", "1000", 1.0),
    ("first 3 then 7", "7", 1.0),         # the last number is the answer
    ("first 7 then 3", "7", 0.0),
    ("\\boxed{41}", "42", 0.0),
    ("\\boxed{2.50}", "2.5", 1.0),
    ("-3", "-3", 1.0),
    ("3", "-3", 0.0),
    ("no number here", "5", 0.0),
    ("\\boxed{x+1}", "x + 1", 1.0),      # non-numeric: whitespace-free string match
    ("\\boxed{\\frac{a}{b}}", "\\boxed{\\frac{a}{b}}", 1.0),
])
def test_math_fallback_hand_made(response, answer, expected):
    assert rewards.math_fallback(response, answer) == expected


def test_math_reward_reports_backend(caplog):
    with caplog.at_level("INFO", logger="megapo.trainer.rewards"):
        fn = rewards.get_reward("math")
    backend = rewards.math_backend()
    assert (fn is rewards.math_fallback) == (backend == "fallback")
    assert any(("fallback" in r.message) == (backend == "fallback") for r in caplog.records)
    assert fn("\\boxed{12}", "12") == 1.0 and fn("\\boxed{13}", "12") == 0.0


def test_user_function(tmp_path, monkeypatch):
    (tmp_path / "my_reward_mod.py").write_text("def score(response, answer):\n    return float(len(response))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = rewards.get_reward("my_reward_mod:score")
    assert fn("abc", "x") == 3.0
    with pytest.raises(ConfigError) as err:
        rewards.get_reward("my_reward_mod:nope")
    assert err.value.field == "data.reward"
    sys.modules.pop("my_reward_mod", None)


def test_overlong_shaping_formula():
    # max 20 tokens, buffer 8: penalty starts after 12 tokens, reaches the full penalty at 20
    lens = [12, 16, 20, 25]
    assert rewards.shape_overlong([1.0] * 4, lens, 20, 8) == pytest.approx([1.0, 1.0 - 4 / 8, 0.0, 0.0])
    assert rewards.shape_overlong([0.0, 0.0], [5, 25], 20, 8, penalty=0.5) == pytest.approx([0.0, -0.5])
