"""A reward model in `megapo train` (data.reward_model: path, coef; megapo/trainer/reward_model.py).

- Config refusals naming data.reward_model.path: a missing folder, a causal-LM (not classification) folder, a
  vocabulary other than the policy's.
- add_model_rewards' arithmetic on groups: r_i + coef · score(prompt_ids + output_ids), in batch order.
- A tiny run with a tiny score model (write_tiny_model(head="score")) and a verifier reward of 0 for every response:
  2 steps, each logging reward/model; the rewards the advantages see are coef × the RM's scores
  (reward/with_model = coef · reward/model), and reward/model is the mean of transformers'
  AutoModelForSequenceClassification scores of the samples the step trained on (samples.jsonl), fp32.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from train_runs import train_rows

ZERO = "def zero(response, answer):\n    return 0.0\n"


@pytest.fixture(scope="module")
def tiny_rm(tiny_model_factory):
    return tiny_model_factory("qwen3_moe", head="score")


def _load(tmp_path, tiny_moe, *overrides):
    from megapo.config import load_config
    from megapo.trainer.config import RunConfig

    return load_config(RunConfig, None, [f"model.path={tiny_moe}", "data.task=addition",
                                         f"train.output_dir={tmp_path / 'run'}", *overrides])


def test_reward_model_refusals_name_the_field(tmp_path, tiny_moe, tiny_model_factory):
    from megapo.config import ConfigError

    other_vocab = tiny_model_factory("qwen3_moe", head="score", vocab=600)
    for path, words in ((tmp_path / "nowhere", "config.json"), (tiny_moe, "ForSequenceClassification"),
                        (other_vocab, "vocab_size")):
        with pytest.raises(ConfigError) as err:
            _load(tmp_path, tiny_moe, f"data.reward_model.path={path}")
        assert err.value.field == "data.reward_model.path", (path, str(err.value))
        assert words in str(err.value), (path, str(err.value))


def test_reward_model_config_accepts_a_score_folder(tmp_path, tiny_moe, tiny_rm):
    cfg = _load(tmp_path, tiny_moe, f"data.reward_model.path={tiny_rm}", "data.reward_model.coef=0.5")
    assert cfg.data.reward_model.enabled and cfg.data.reward_model.coef == 0.5
    assert not _load(tmp_path, tiny_moe).data.reward_model.enabled  # off by default


def test_add_model_rewards_adds_coef_times_the_score_of_prompt_and_response():
    from megapo.trainer.reward_model import add_model_rewards

    class FakeRM:
        def scores(self, sequences):
            self.seen = sequences
            return [float(sum(s)) for s in sequences]

    def sample(p, o):
        return SimpleNamespace(prompt_ids=p, output_ids=o)

    groups = [SimpleNamespace(samples=[sample([1], [2, 3]), sample([1], [4])], rewards=[1.0, 0.0]),
              SimpleNamespace(samples=[sample([5, 6], [7])], rewards=[0.5])]
    rm = FakeRM()
    m = add_model_rewards(rm, groups, 0.1)
    assert rm.seen == [[1, 2, 3], [1, 4], [5, 6, 7]]
    assert groups[0].rewards == pytest.approx([1.0 + 0.6, 0.0 + 0.5]) and groups[1].rewards == pytest.approx([2.3])
    assert m["reward/model"] == pytest.approx((6 + 5 + 18) / 3)
    assert m["reward/with_model"] == pytest.approx((1.6 + 0.5 + 2.3) / 3)


def test_a_run_with_a_reward_model_adds_coef_times_its_scores(tmp_path, tiny_moe, tiny_rm):
    import torch
    from transformers import AutoModelForSequenceClassification

    (tmp_path / "zero_reward.py").write_text(ZERO)
    coef = 3.0
    rows = train_rows(tmp_path, "rm", f"model.path={tiny_moe}", "train.steps=2", "data.reward=zero_reward:zero",
                      f"data.reward_model.path={tiny_rm}", f"data.reward_model.coef={coef}", "train.log_samples=true",
                      "data.prompts_per_step=4", "rollout.n_samples=4")  # 16 samples a step, each scored again below
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["reward"] == 0.0  # the verifier's, logged as before
        assert r["reward/model"] != 0.0
        assert r["reward/with_model"] == pytest.approx(coef * r["reward/model"], abs=1e-6)
    # independent: transformers' scores of the trained sequences, averaged per step
    hf = AutoModelForSequenceClassification.from_pretrained(tiny_rm, torch_dtype=torch.float32).eval()
    samples = [json.loads(line) for line in (tmp_path / "rm" / "samples.jsonl").read_text().splitlines()]
    for r in rows:
        mine = [s for s in samples if s["step"] == r["step"]]
        assert mine
        with torch.no_grad():
            scores = [float(hf(torch.tensor([s["prompt_ids"] + s["response_ids"]])).logits[0, 0]) for s in mine]
        assert r["reward/model"] == pytest.approx(sum(scores) / len(scores), abs=1e-5)
