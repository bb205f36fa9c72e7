"""megapo.trainer.rollout_store: batches made ahead survive a write and a read unchanged (every field of
every record compared here by hand, arrays by value and kind), and a store naming a type outside its list
is refused."""

import json

import numpy as np
import pytest
import torch

from megapo.engines.base import Sample
from megapo.envs.base import Trajectory
from megapo.tasks.base import Example
from megapo.trainer.async_rollout import Batch
from megapo.trainer.rollout import Group
from megapo.trainer.rollout_store import JSON_FILE, load_batches, save_batches


def _batches():
    buffer = np.arange(2 * 3 * 2 * 2, dtype=np.int32).reshape(2, 3, 2, 2)  # samples' routes: views of one buffer
    plain = Sample([1, 2], [3, 4], [-0.5, -0.25], "stop", 2, routes=buffer[0])
    cut = Sample([1, 2], [5, 6], [-1.0, -2.0], "length", 1, routes=buffer[1])
    turn = Trajectory([7], [8, 9, 10], [-0.1, 0.0, -0.3], "stop", 3, routes=torch.ones(3, 2, 2, dtype=torch.int32),
                      loss_mask=[1, 0, 1], turns=2, tool_calls=1, finish="answer", env_reward=None, last_turn=(2, 3))
    groups = [Group(Example("1+2=", "3", {"digits": 1}, difficulty=1), [plain, cut], [1.0, 0.0],
                    scores=[1.0, 0.5], correct=[True, False], sampled=4, prompt_index=7, sample_ids=[0, 3]),
              Group(Example("x", "y"), [turn], [0.25], prompt_index=2)]
    return [Batch(groups, {"reward": 0.5, "len/mean": 2.0}, 7, 0.125, 1), Batch([], {}, 0, 0.0, 2)]


def _same_sample(a, b):
    assert type(a) is type(b)
    for name in ("prompt_ids", "output_ids", "logprobs", "finish_reason", "weight_version"):
        assert getattr(a, name) == getattr(b, name), name
    assert type(a.routes) is type(b.routes) and np.array_equal(np.asarray(a.routes), np.asarray(b.routes))
    assert np.asarray(b.routes).dtype == np.asarray(a.routes).dtype
    if isinstance(a, Trajectory):
        for name in ("loss_mask", "turns", "tool_calls", "finish", "env_reward", "last_turn"):
            assert getattr(a, name) == getattr(b, name), name
        assert isinstance(b.last_turn, tuple)


def test_batches_round_trip(tmp_path):
    want = _batches()
    save_batches(tmp_path, want)
    got = load_batches(tmp_path)
    assert len(got) == len(want)
    for a, b in zip(want, got):
        assert (a.metrics, a.tokens, a.generate_s, a.start_version) == (b.metrics, b.tokens, b.generate_s,
                                                                        b.start_version)
        assert len(a.groups) == len(b.groups)
        for ga, gb in zip(a.groups, b.groups):
            assert (ga.example, ga.example.meta, ga.example.difficulty) == (gb.example, gb.example.meta,
                                                                            gb.example.difficulty)
            for name in ("rewards", "scores", "correct", "sampled", "prompt_index", "sample_ids"):
                assert getattr(ga, name) == getattr(gb, name), name
            for sa, sb in zip(ga.samples, gb.samples, strict=True):
                _same_sample(sa, sb)
    assert load_batches(tmp_path / "nothing-here") == []


def test_unknown_record_type_refused(tmp_path):
    save_batches(tmp_path, _batches()[1:])
    data = json.loads((tmp_path / JSON_FILE).read_text())
    data["batches"][0]["__type__"] = "Popen"
    (tmp_path / JSON_FILE).write_text(json.dumps(data))
    with pytest.raises(ValueError, match="unknown record type 'Popen'"):
        load_batches(tmp_path)
