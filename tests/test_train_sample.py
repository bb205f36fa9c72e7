"""TrainSample (megapo/learner/sample.py): a None field is absent for the learner's by-name reads, a name
outside the fields is refused naming it, and the trainer's samples are TrainSample records whose fields are
the groups' tokens, log-probs, masks and routes (written out here from the samples)."""

import numpy as np
import pytest

from megapo.learner.sample import FIELDS, OPTIONAL_FIELDS, TOKEN_FIELDS, TrainSample


def test_absent_fields_read_like_missing_keys():
    s = TrainSample(tokens=[1, 2, 3], prompt_len=2, advantage=0.5, rollout_logp=[-1.0])
    assert s["tokens"] == [1, 2, 3] and "rollout_logp" in s and "old_logp" not in s
    assert s.get("ref_logp") is None and s.get("ref_logp", 7) == 7
    with pytest.raises(KeyError):
        s["old_logp"]
    s["old_logp"] = [-0.5]
    assert s.old_logp == [-0.5] and "old_logp" in s
    assert dict(s.items()) == {"tokens": [1, 2, 3], "prompt_len": 2, "advantage": 0.5, "rollout_logp": [-1.0],
                               "old_logp": [-0.5]}
    with pytest.raises(KeyError, match="no field 'old_lgp'"):
        s["old_lgp"] = [0.0]
    assert "old_lgp" not in s
    assert set(TOKEN_FIELDS) <= set(FIELDS) and set(OPTIONAL_FIELDS) <= set(TOKEN_FIELDS)


def test_the_trainer_builds_train_samples():
    from types import SimpleNamespace

    from megapo.envs.base import Trajectory
    from megapo.tasks.base import Example
    from megapo.trainer.config import RunConfig
    from megapo.trainer.rollout import Group
    from megapo.trainer.update import train_samples

    cfg = RunConfig()
    cfg.rollout.n_samples = 2
    cfg.algorithm.routing_replay = "r3"
    routes = np.zeros((3, 1, 2), dtype=np.int32)
    plain = SimpleNamespace(prompt_ids=[1, 2], output_ids=[3, 4], logprobs=[-0.1, -0.2], routes=routes,
                            finish_reason="stop")
    turn = Trajectory([1, 2], [5, 6], [-0.3, 0.0], "stop", 0, routes=routes, loss_mask=[1, 0])
    batch = train_samples([Group(Example("p", "a"), [plain, turn], [1.0, 0.0])], cfg)
    assert all(isinstance(s, TrainSample) for s in batch)
    assert [s.tokens for s in batch] == [[1, 2, 3, 4], [1, 2, 5, 6]] and [s.prompt_len for s in batch] == [2, 2]
    grpo = 0.5 / (0.5 ** 0.5 + 1e-6)  # (r - mean) / (std + eps), std with n - 1, eps 1e-6
    assert [s.advantage for s in batch] == pytest.approx([grpo, -grpo], rel=1e-12)
    assert [s.rollout_logp for s in batch] == [[-0.1, -0.2], [-0.3, 0.0]]
    assert batch[0].loss_mask is None and batch[1].loss_mask == [1, 0]
    assert all(s.routes is routes and s.engine_routes is routes for s in batch)
