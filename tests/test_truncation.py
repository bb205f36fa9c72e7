"""A response cut at rollout.max_new_tokens (no end-of-sequence) gets data.truncated_reward, never a score of its
unfinished text, under every reward (built-in and user), through the one reward path GuardedReward.score_all;
the loop reports the share as reward/truncated_frac."""

import pytest

from megapo.config import ConfigError, load_config
from megapo.trainer import rewards
from megapo.trainer.config import RunConfig

COUNTING_REWARD = '''
calls = []


def always_one(response, answer):
    calls.append(response)
    return 1.0
'''

# (reward spec, a response whose text that reward scores 1, its reference answer)
SCORED_ONE = [("exact_match", "0579", "0579"), ("math", "so the sum is 579", "579"),
              ("megapo.tasks.addition_cot:reward", "9+0+0=09;7+5+0=12;129", "129")]


@pytest.mark.parametrize("spec,response,answer", SCORED_ONE)
@pytest.mark.parametrize("timeout_s", [0.0, 5.0])  # caller's thread, worker thread
def test_builtin_rewards_give_a_truncated_response_the_truncated_reward(spec, response, answer, timeout_s):
    guarded = rewards.GuardedReward(spec, timeout_s, truncated_reward=-0.5)
    pairs = [(response, answer), (response, answer), ("nonsense", answer)]
    assert guarded.score_all(pairs) == [1.0, 1.0, 0.0]  # no flags: every text is scored
    assert guarded.score_all(pairs, truncated=[False, True, True]) == [1.0, -0.5, -0.5]
    assert guarded.pop_truncated() == (2, 6) and guarded.pop_truncated() == (0, 0)
    default = rewards.GuardedReward(spec, timeout_s)
    assert default.score_all(pairs, truncated=[True, False, False]) == [0.0, 1.0, 0.0]
    guarded.close()
    default.close()


def test_a_user_reward_is_not_called_on_a_truncated_response(user_module):
    name = user_module("counting_reward_mod", COUNTING_REWARD)
    import counting_reward_mod

    guarded = rewards.GuardedReward(f"{name}:always_one", timeout_s=5.0)
    out = guarded.score_all([("a", "x"), ("b", "x"), ("c", "x")], truncated=[True, False, True])
    assert out == [0.0, 1.0, 0.0] and counting_reward_mod.calls == ["b"]
    off = rewards.GuardedReward(f"{name}:always_one", timeout_s=0, truncated_reward=None)  # null: score the text
    assert off.score_all([("d", "x")], truncated=[True]) == [1.0] and counting_reward_mod.calls == ["b", "d"]
    with pytest.raises(ValueError, match="2 truncated flags for 3 responses"):
        guarded.score_all([("a", "x")] * 3, truncated=[True, False])
    guarded.close()


def _loop_rewards(tiny_moe, user_module, reward: str, *over):
    """collect_rollouts with an engine whose 4 samples per prompt are all the right answer: two end with
    end-of-sequence ("stop"), two are cut ("length", no EOS)."""
    from transformers import AutoTokenizer

    from megapo.engines.base import Sample
    from megapo.trainer import data
    from megapo.trainer.rollout import collect_rollouts, make_reward_fn

    tok = AutoTokenizer.from_pretrained(tiny_moe)
    cfg = load_config(RunConfig, None, [f"model.path={tiny_moe}", "data.task=addition", "rollout.n_samples=4",
                                        "data.prompts_per_step=2", f"data.reward={reward}", *over])
    pool = data.prompt_pool(cfg, tok)

    class Engine:
        def generate(self, prompts, params):
            out = []
            for p in prompts:
                ex = next(e for e, ids in (pool[i] for i in range(4)) if ids == p)
                right = list(tok(ex.answer, add_special_tokens=False)["input_ids"])
                out.append([Sample(p, right + [tok.eos_token_id], [0.0] * 5, "stop", 0),
                            Sample(p, right, [0.0] * 4, "length", 0),
                            Sample(p, right + [tok.eos_token_id], [0.0] * 5, "stop", 0),
                            Sample(p, right, [0.0] * 4, "abort", 0)])
            return out

    source = data.PromptSource(4, shuffle=False)
    params = type("P", (), {"n": 4})()
    groups, metrics, _ = collect_rollouts(Engine(), params, pool, source, make_reward_fn(cfg, tok), cfg)
    return [g.rewards for g in groups], metrics


@pytest.mark.parametrize("reward", ["exact_match", "math", "user"])
def test_the_loop_gives_cut_responses_the_truncated_reward(tiny_moe, user_module, reward):
    if reward == "user":
        reward = f"{user_module('counting_reward_mod2', COUNTING_REWARD)}:always_one"
    got, metrics = _loop_rewards(tiny_moe, user_module, reward)
    assert got == [[1.0, 0.0, 1.0, 0.0]] * 2 and metrics["reward/truncated_frac"] == 0.5
    assert metrics["reward"] == 0.5
    got, metrics = _loop_rewards(tiny_moe, user_module, reward, "data.truncated_reward=-1")
    assert got == [[1.0, -1.0, 1.0, -1.0]] * 2
    got, metrics = _loop_rewards(tiny_moe, user_module, reward, "data.truncated_reward=null")
    assert got == [[1.0] * 4] * 2 and metrics["reward/truncated_frac"] == 0.0


def test_truncated_reward_must_be_finite(tiny_moe):
    for value in ("nan", "inf", "'zero'"):
        with pytest.raises(ConfigError) as err:
            load_config(RunConfig, None, [f"model.path={tiny_moe}", "data.task=addition",
                                          f"data.truncated_reward={value}"])
        assert err.value.field == "data.truncated_reward"
