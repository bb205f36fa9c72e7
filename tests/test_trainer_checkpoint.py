"""Checkpoints: atomic, resumable (RNG and cursor restored), pruned to keep_last, partial ones ignored."""

import json
import random

import numpy as np
import pytest
import torch

from megapo.trainer import checkpoint as ck


def _fake_learner_save(d):
    (d / "weights.bin").write_bytes(b"w" * 16)


def test_save_load_roundtrip_restores_rng(tmp_path):
    random.seed(1); np.random.seed(1); torch.manual_seed(1)
    state = ck.TrainerState(step=5, data_cursor={"epoch": 1, "index": 3, "seed": 0}, weight_version=5,
                            extra={"best": 0.5})
    path = ck.save_checkpoint(tmp_path, state, _fake_learner_save)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9); np.random.seed(9); torch.manual_seed(9)
    loaded = []
    got_state = ck.load_checkpoint(path, lambda d: loaded.append((d / "weights.bin").read_bytes()))
    assert got_state == state
    assert loaded == [b"w" * 16]
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_keep_last_and_latest(tmp_path):
    for step in (10, 20, 30, 40):
        ck.save_checkpoint(tmp_path, ck.TrainerState(step, {}, step), _fake_learner_save, keep_last=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step_00000030", "step_00000040"]
    assert ck.latest_checkpoint(tmp_path).name == "step_00000040"
    assert ck.latest_checkpoint(tmp_path / "none") is None


def test_crash_mid_save_never_looks_valid(tmp_path):
    ck.save_checkpoint(tmp_path, ck.TrainerState(10, {}, 10), _fake_learner_save)

    def crash(d):
        (d / "half").write_bytes(b"x")
        raise RuntimeError("disk died")

    with pytest.raises(RuntimeError):
        ck.save_checkpoint(tmp_path, ck.TrainerState(20, {}, 20), crash)
    assert (tmp_path / "step_00000020.tmp").is_dir()  # the partial write is there ...
    assert ck.latest_checkpoint(tmp_path).name == "step_00000010"  # ... but not taken for a checkpoint
    # a folder with the final name but no state file (e.g. copied half-way) is not valid either
    (tmp_path / "step_00000030").mkdir()
    assert ck.latest_checkpoint(tmp_path).name == "step_00000010"
    with pytest.raises(FileNotFoundError):
        ck.load_checkpoint(tmp_path / "step_00000030")
    # the next save of that step cleans the leftover and succeeds
    ck.save_checkpoint(tmp_path, ck.TrainerState(20, {"epoch": 0}, 20), _fake_learner_save, keep_last=5)
    assert not (tmp_path / "step_00000020.tmp").exists()
    assert json.loads((tmp_path / "step_00000020" / ck.STATE_FILE).read_text())["step"] == 20
    assert ck.latest_checkpoint(tmp_path).name == "step_00000020"
