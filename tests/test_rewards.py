"""Reward functions against hand-made cases."""

import subprocess
import sys
from pathlib import Path

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


def test_user_function(user_module):
    user_module("my_reward_mod", "def score(response, answer):\n    return float(len(response))\n")
    fn = rewards.get_reward("my_reward_mod:score")
    assert fn("abc", "x") == 3.0
    with pytest.raises(ConfigError) as err:
        rewards.get_reward("my_reward_mod:nope")
    assert err.value.field == "data.reward"


def test_overlong_shaping_formula():
    import torch

    from megapo.algorithms.length import shape_rewards

    def shape_overlong(r, lens, max_len, buffer, penalty=1.0):  # data.overlong's spelling of dapo_overlong
        return shape_rewards("dapo_overlong", torch.tensor(r, dtype=torch.float64), torch.tensor(lens),
                             max_len=max_len, cache_len=buffer, factor=penalty).tolist()

    # max 20 tokens, buffer 8: penalty starts after 12 tokens, reaches the full penalty at 20
    lens = [12, 16, 20, 25]
    assert shape_overlong([1.0] * 4, lens, 20, 8) == pytest.approx([1.0, 1.0 - 4 / 8, 0.0, 0.0])
    assert shape_overlong([0.0, 0.0], [5, 25], 20, 8, penalty=0.5) == pytest.approx([0.0, -0.5])


# ----------------------------------------------------------------------------- guarded calls

BAD_REWARDS = '''
import threading

def raises(response, answer):
    raise ValueError("boom")

def nan(response, answer):
    return float("nan")

def none(response, answer):
    return None

def text(response, answer):
    return "1.0"

def one_arg(response):
    return 1.0

def three_args(response, answer, extra):
    return 1.0

def with_defaults(response, answer, scale=1.0, **kw):
    return scale

def flag(response, answer):
    return response == answer

def hangs_on(response, answer):
    if response == "hang":
        while True:  # pure Python: the timeout's interrupt ends it
            pass
    return 1.0
'''


@pytest.fixture()
def bad_rewards(user_module):
    return user_module("bad_rewards_mod", BAD_REWARDS)


@pytest.mark.parametrize("name", ["one_arg", "three_args"])
def test_wrong_signature_refused_when_resolved(bad_rewards, name):
    with pytest.raises(ConfigError) as err:
        rewards.get_reward(f"{bad_rewards}:{name}")
    assert err.value.field == "data.reward"
    assert f"'{bad_rewards}:{name}' must take (response, answer)" in str(err.value)
    assert f"{name}(response" in str(err.value)


def test_compatible_signatures_and_bools_accepted(bad_rewards):
    assert rewards.GuardedReward(f"{bad_rewards}:with_defaults", timeout_s=0)("x", "y") == 1.0
    flag = rewards.GuardedReward(f"{bad_rewards}:flag")
    assert (flag("a", "a"), flag("a", "b")) == (1.0, 0.0)  # a bool counts as 1/0
    flag.close()


@pytest.mark.parametrize("name, problem", [
    ("raises", "raised ValueError: boom"),
    ("nan", "returned nan (a float); a reward must be a finite number"),
    ("none", "returned None (a NoneType)"),
    ("text", "returned '1.0' (a str)"),  # not read as 1.0
])
@pytest.mark.parametrize("timeout_s", [0, 30])  # inline, and on the worker thread
def test_reward_failures_name_the_reward_and_sample(bad_rewards, name, problem, timeout_s):
    spec = f"{bad_rewards}:{name}"
    fail = rewards.GuardedReward(spec, timeout_s, "fail")
    with pytest.raises(rewards.RewardError) as err:
        fail("the response " + "x" * 500, "the answer")
    msg = str(err.value)
    assert msg.startswith(f"reward '{spec}' {problem}"), msg
    assert "on response 'the response xxx" in msg and "with answer 'the answer'" in msg
    assert len(msg) < 500  # the sample is truncated
    zero = rewards.GuardedReward(spec, timeout_s, "zero")
    assert [zero("r", "a"), zero("r", "a")] == [0.0, 0.0]
    assert zero.pop_errors() == 2 and zero.pop_errors() == 0
    fail.close()
    zero.close()


def test_hung_reward_times_out_and_its_thread_ends(bad_rewards):
    import threading

    spec = f"{bad_rewards}:hangs_on"
    zero = rewards.GuardedReward(spec, timeout_s=0.3, errors="zero")
    before = set(threading.enumerate())  # reward threads of earlier tests' live GuardedRewards are not this one's
    assert zero("fine", "a") == 1.0
    hung = [t for t in threading.enumerate() if t.name == "megapo-reward" and t.is_alive() and t not in before]
    assert zero("hang", "a") == 0.0 and zero.pop_errors() == 1
    assert zero("fine", "a") == 1.0  # a fresh thread serves the next call
    assert hung  # the thread that served the first call, abandoned by the second
    for t in hung:
        t.join(30)  # interrupted by the timeout: the abandoned thread does not spin forever
    assert not any(t.is_alive() for t in hung)
    zero.close()
    fail = rewards.GuardedReward(spec, timeout_s=0.3, errors="fail")
    with pytest.raises(rewards.RewardError, match=rf"reward '{spec}' did not return within "
                                                  r"data.reward_timeout_s=0.3 s, on response 'hang'"):
        fail("hang", "a")
    fail.close()


def test_a_list_is_scored_in_order_and_a_hang_inside_it_costs_only_that_call(bad_rewards):
    """score_all hands the whole list to the worker; a call past the timeout scores 0 (zero) or raises
    naming it (fail), and the calls after it are still made, in order, on a fresh thread."""
    spec = f"{bad_rewards}:raises"
    pairs = [("a", "a"), ("b", "a"), ("hang", "a"), ("c", "a")]
    expected = [1.0 if r == a else 0.0 for r, a in pairs]  # exact_match, written out
    guarded = rewards.GuardedReward("exact_match", timeout_s=5.0)
    assert guarded.score_all(pairs) == expected
    guarded.close()
    zero = rewards.GuardedReward(f"{bad_rewards}:hangs_on", timeout_s=0.3, errors="zero")
    assert zero.score_all(pairs) == [1.0, 1.0, 0.0, 1.0] and zero.pop_errors() == 1
    zero.close()
    fail = rewards.GuardedReward(f"{bad_rewards}:hangs_on", timeout_s=0.3, errors="fail")
    with pytest.raises(rewards.RewardError, match="did not return within .* on response 'hang'"):
        fail.score_all(pairs)
    fail.close()
    raising = rewards.GuardedReward(spec, timeout_s=5.0, errors="zero")
    assert raising.score_all(pairs) == [0.0] * 4 and raising.pop_errors() == 4
    raising.close()


def test_reward_checked_before_anything_starts(bad_rewards, tmp_path, tiny_moe, capsys):
    """`megapo train` with a reward that fails on the first example: exit 2 naming it, nothing written."""
    from megapo.cli import main

    out = tmp_path / "run"
    argv = ["train", "megapo/configs/tiny_moe_addition.yaml", f"model.path={tiny_moe}", "model.tiny=null",
            f"train.output_dir={out}", f"data.reward={bad_rewards}:nan"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"data.reward: start-up check: reward '{bad_rewards}:nan' returned nan" in err, err
    assert "on response '" in err
    assert not out.exists()
    assert main(argv[:-1] + [f"data.reward={bad_rewards}:one_arg"]) == 2
    assert "must take (response, answer)" in capsys.readouterr().err


STRICT_REWARD = '''
def strict(response, answer):
    if response != answer:
        raise ValueError("not the answer")
    return 1.0
'''


def test_loop_scores_failures_zero_and_counts_them(user_module, tiny_moe):
    """make_reward_fn + collect_rollouts: with reward_errors=zero a failing call scores 0 and is counted in
    reward/errors; with fail the step stops with RewardError naming the reward."""
    from transformers import AutoTokenizer

    from megapo.config import load_config
    from megapo.engines.base import Sample
    from megapo.trainer import data
    from megapo.trainer.rollout import collect_rollouts, make_reward_fn
    from megapo.trainer.config import RunConfig

    user_module("strict_reward_mod", STRICT_REWARD)
    tok = AutoTokenizer.from_pretrained(tiny_moe)

    class Engine:  # sample 0 of each prompt is the right answer then EOS, the others a wrong "7" then EOS
        def generate(self, prompts, params):
            right = [list(tok(pool[0][0].answer, add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]]
            wrong = list(tok("7", add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]
            return [[Sample(p, ids, [0.0] * len(ids), "stop", 0)
                     for k, ids in enumerate(right + [wrong] * (params.n - 1))] for p in prompts]

    def cfg_for(errors):
        return load_config(RunConfig, None, [f"model.path={tiny_moe}", "data.task=addition", "rollout.n_samples=4",
                                             "data.prompts_per_step=1", "data.reward=strict_reward_mod:strict",
                                             f"data.reward_errors={errors}"])

    cfg = cfg_for("zero")
    pool = data.prompt_pool(cfg, tok)
    source = data.PromptSource(1, shuffle=False)  # always pool[0]
    params = type("P", (), {"n": 4})()
    groups, metrics, _ = collect_rollouts(Engine(), params, pool, source, make_reward_fn(cfg, tok), cfg)
    assert groups[0].rewards == [1.0, 0.0, 0.0, 0.0]
    assert metrics["reward/errors"] == 3 and metrics["reward"] == 0.25
    cfg = cfg_for("fail")
    with pytest.raises(rewards.RewardError, match=r"reward 'strict_reward_mod:strict' raised ValueError: not the "
                                                  r"answer, on response '7'"):
        collect_rollouts(Engine(), params, pool, source, make_reward_fn(cfg, tok), cfg)


FLAKY_REWARD = '''
calls = [0]


def flaky(response, answer):
    calls[0] += 1
    if calls[0] > 1:  # the start-up check's call passes; the first rollout's fail
        raise ValueError("the grader is down")
    return 1.0
'''


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_reward_that_fails_mid_run_ends_in_one_line_exit_1(tmp_path, tiny_moe, mode):
    """data.reward_errors=fail: a reward raising in the first rollout (sync, or the async rollout thread) ends
    `megapo train` with exit 1 and one line naming the reward and its error, no traceback, no checkpoint."""
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "flaky_reward.py").write_text(FLAKY_REWARD)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megapo.cli", "train", str(root / "megapo/configs/tiny_moe_addition.yaml"),
           f"model.path={tiny_moe}", "sft.enabled=false", f"train.output_dir={out}", "train.steps=2",
           "train.eval_every=0", "train.log=[jsonl]", "data.prompts_per_step=2", "rollout.n_samples=2",
           "rollout.max_new_tokens=4", "data.dynamic_sampling=false", "data.reward=flaky_reward:flaky",
           "data.truncated_reward=null",  # the random model's responses are all cut at 4 tokens: score them
           "data.reward_errors=fail", "algorithm.routing_replay=off", f"train.mode={mode}"]
    env = {"PYTHONPATH": f"{tmp_path}:{root}", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("megapo train: ")]
    assert line.startswith("megapo train: reward 'flaky_reward:flaky' raised ValueError: the grader is down, on "
                           "response "), line
    assert not list(out.glob("checkpoints/step_*"))
