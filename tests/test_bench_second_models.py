"""megapo bench second-models (tools/bench/second_models.py): its ratios and bytes against the arithmetic written out
here, the run config it measures (every role on, accepted by the config's own checks), and the CLI's refusal of
--rounds 0. The measured run itself: benchmarks/results/second_models.json."""

from __future__ import annotations

import pytest
import torch

from megapo.cli import main
from tools.bench.second_models import run_config, summary
from tools.bench.side_by_side import param_bytes


def test_summary_is_the_medians_over_the_policy_step():
    samples = {"policy_step": [2.0, 1.0, 4.0], "teacher": [1.0, 0.5, 0.5], "reward_model": [0.25, 0.25, 9.0],
               "critic": [3.0, 2.0, 1.0], "critic_values": [0.5, 1.0, 0.5]}
    med, ratios = summary(samples)
    assert med == {"policy_step": 2.0, "teacher": 0.5, "reward_model": 0.25, "critic": 2.0, "critic_values": 0.5}
    assert ratios == pytest.approx({"teacher_of_policy_step": 0.25, "reward_model_of_policy_step": 0.125,
                                    "critic_of_policy_step": 1.0, "critic_values_of_policy_step": 0.25,
                                    "step_with_all_roles_over_policy_step": (2.0 + 0.5 + 0.25 + 2.0) / 2.0})


def test_param_bytes_count_weights_and_for_trained_roles_grads_and_adam():
    layer = torch.nn.Linear(3, 5)  # 15 + 5 fp32 parameters
    assert param_bytes(layer) == 20 * 4
    assert param_bytes(layer, trained=True) == 20 * 4 * 4  # + fp32 gradient + Adam's two moments
    assert param_bytes(layer.to(torch.bfloat16)) == 20 * 2


def test_run_config_turns_every_role_on(tiny_model_factory, tiny_moe):
    # (the student itself is a valid teacher; the score-head folder is the one tests/test_critic.py builds)
    models = {"policy": tiny_moe, "teacher": tiny_moe, "reward_model": tiny_model_factory("qwen3_moe", head="score")}
    cfg = run_config(models)
    assert cfg.algorithm.distill.teacher == str(models["teacher"])
    assert cfg.data.reward_model.path == str(models["reward_model"])
    assert cfg.algorithm.critic.path == "policy" and cfg.algorithm.advantage == "gae"
    assert cfg.algorithm.routing_replay == "r3"  # the main job's: the teacher and the critic replay its routes


def test_rounds_below_one_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="--rounds must be >= 1"):
        main(["bench", "second-models", "--rounds", "0", "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()
