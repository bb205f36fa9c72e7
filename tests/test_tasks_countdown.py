"""Countdown: generated problems are solvable and split-disjoint; the verifier on hand-made cases."""

import itertools
import json
from fractions import Fraction

from megapo.tasks import countdown


def _solvable(numbers, target):
    """Brute force over orders and + - * applied left to right (how the generator builds targets)."""
    for perm in itertools.permutations(numbers):
        for ops in itertools.product("+-*", repeat=len(numbers) - 1):
            v = Fraction(perm[0])
            for op, n in zip(ops, perm[1:]):
                v = v + n if op == "+" else v - n if op == "-" else v * n
            if v == target:
                return True
    return False


def test_problems_solvable_and_splits_disjoint():
    keys = {}
    for split in countdown.SPLITS:
        exs = countdown.examples(split, 40, seed=1)
        assert len({e.prompt for e in exs}) == 40
        for e in exs:
            ref = json.loads(e.answer)
            assert _solvable(ref["numbers"], ref["target"])
            assert e.prompt == f"numbers {' '.join(map(str, ref['numbers']))} target {ref['target']}:"
        keys[split] = {e.prompt for e in exs}
    assert not keys["train"] & keys["test"] and not keys["train"] & keys["validation"]
    assert not keys["test"] & keys["validation"]
    again = [e.prompt for e in countdown.examples("test", 40, seed=1)]
    assert set(again) == keys["test"]  # the same seed draws the same problems
    assert set(e.prompt for e in countdown.examples("test", 40, seed=2)) != keys["test"]


def test_reward_hand_made():
    ans = json.dumps({"numbers": [3, 5, 7], "target": 22})
    assert countdown.reward("3*5+7", ans) == 1.0
    assert countdown.reward(" (7+5)*3-14 ", ans) == 0.0  # 14 is not given
    assert countdown.reward("7*3+5-3", ans) == 0.0         # 3 used twice
    assert countdown.reward("3*5+7 = 22\nbecause...", ans) == 1.0
    assert countdown.reward("3*5+6", ans) == 0.0
    assert countdown.reward("__import__('os')", ans) == 0.0
    assert countdown.reward("3**5", ans) == 0.0
    assert countdown.reward("5/0+7", ans) == 0.0
    assert countdown.reward("", ans) == 0.0
    ans = json.dumps({"numbers": [6, 4, 3], "target": 2})
    assert countdown.reward("6/(4-3)-4", ans) == 0.0  # 4 twice
    assert countdown.reward("(6+4)/5", ans) == 0.0
    assert countdown.reward("6/3", ans) == 1.0
    assert countdown.evaluate_expression("(1+2)/4") == (Fraction(3, 4), [1, 2, 4])


def test_reward_usable_as_config_reward():
    from megapo.trainer.rewards import get_reward

    fn = get_reward("megapo.tasks.countdown:reward")
    assert fn("3*5+7", json.dumps({"numbers": [3, 5, 7], "target": 22})) == 1.0


def test_jsonl_export_runs_through_config_and_data(tmp_path, tiny_moe):
    from megapo.config import load_config
    from megapo.trainer.config import RunConfig
    from megapo.trainer.data import load_examples
    from megapo.trainer.rewards import get_reward

    path = tmp_path / "countdown.jsonl"
    countdown.write_jsonl(path, "train", 10, seed=0)
    cfg = load_config(RunConfig, None, [f"model.path={tiny_moe}", f"data.train_files=[{path}]",
                                        "data.reward=megapo.tasks.countdown:reward", "data.max_prompt_tokens=64"])
    exs = load_examples(cfg.data.train_files, "prompt", "answer")
    assert len(exs) == 10
    ref = json.loads(exs[0].answer)
    assert get_reward(cfg.data.reward)("+".join(map(str, ref["numbers"])), exs[0].answer) == float(
        sum(ref["numbers"]) == ref["target"])
