"""Checkpoints: atomic, resumable (RNG and cursor restored), pruned to keep_last, partial ones ignored;
no pickles (RNG state as safetensors + JSON); a manifest (sizes, sha256) verified before loading, with
every kind of damage named and the newest earlier checkpoint that verifies offered; non-finite weights
never saved or exported.

References: hashlib's sha256 and os.stat of each file, the file the test damaged, the tensor the test
made NaN, a marker file a hostile pickle would write."""

import hashlib
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megapo.trainer import checkpoint as ck

ROOT = Path(__file__).resolve().parents[1]
POISONED = "decoder.layers.0.self_attention.linear_qkv.weight"  # TP-sharded: the NaN is in rank 1's half only


def _fake_learner_save(d):
    (d / "weights.bin").write_bytes(b"w" * 16)


class Payload:
    """A pickle that, when loaded, writes a marker file (what a hostile checkpoint would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


def _never(_):
    raise AssertionError("the learner must not be loaded from a checkpoint that failed verification")


def test_save_load_roundtrip_restores_rng(tmp_path):
    random.seed(1); np.random.seed(1); torch.manual_seed(1)
    np.random.randn()  # numpy now holds a cached gaussian: that is state too
    state = ck.TrainerState(step=5, data_cursor={"epoch": 1, "index": 3, "seed": 0}, weight_version=5,
                            extra={"best": 0.5})
    engine = torch.Generator().manual_seed(11)
    torch.rand(3, generator=engine)
    path = ck.save_checkpoint(tmp_path, state, _fake_learner_save, rng_extra={"engine": engine.get_state()})
    expected = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(1).item())
    expected_engine = torch.rand(4, generator=engine)
    random.seed(9); np.random.seed(9); torch.manual_seed(9)
    loaded = []
    got_state = ck.load_checkpoint(path, lambda d: loaded.append((d / "weights.bin").read_bytes()))
    assert got_state == state
    assert loaded == [b"w" * 16]
    assert (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(1).item()) == expected
    restored = torch.Generator()
    restored.set_state(ck.rng_extra(path)["engine"])
    assert torch.equal(torch.rand(4, generator=restored), expected_engine)


def test_no_pickle_is_written_and_the_manifest_lists_every_file(tmp_path):
    path = ck.save_checkpoint(tmp_path, ck.TrainerState(3, {}, 3), _fake_learner_save,
                              rng_extra={"engine": torch.Generator().get_state()})
    on_disk = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    manifest = json.loads((path / ck.MANIFEST).read_text())
    assert sorted(manifest["files"]) == [n for n in on_disk if n != ck.MANIFEST]
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    for name in on_disk:  # pickle protocol 2+ starts with 0x80; torch.save's zip with "PK"
        head = (path / name).read_bytes()[:2]
        assert head[:1] != b"\x80" and head != b"PK", name


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
    with pytest.raises(ck.CheckpointError, match="no manifest.json"):
        ck.load_checkpoint(tmp_path / "step_00000030")
    # the next save of that step cleans the leftover and succeeds
    ck.save_checkpoint(tmp_path, ck.TrainerState(20, {"epoch": 0}, 20), _fake_learner_save, keep_last=5)
    assert not (tmp_path / "step_00000020.tmp").exists()
    assert json.loads((tmp_path / "step_00000020" / ck.STATE_FILE).read_text())["step"] == 20
    assert ck.latest_checkpoint(tmp_path).name == "step_00000020"


def test_hostile_rng_pickle_of_an_old_checkpoint_is_never_run(tmp_path):
    """A pre-manifest checkpoint (trainer_state.json + rng.pt) whose rng.pt carries a payload: refused,
    naming rng.pt, and the payload's marker file is never written."""
    old = tmp_path / "step_00000004"
    (old / "learner").mkdir(parents=True)
    (old / ck.STATE_FILE).write_text(json.dumps({"step": 4, "data_cursor": {}, "weight_version": 4, "extra": {}}))
    marker = tmp_path / "payload_ran"
    (old / "rng.pt").write_bytes(pickle.dumps(Payload(marker)))
    assert ck.latest_checkpoint(tmp_path) == old  # it counts as a previous run (not silently skipped)
    with pytest.raises(ck.CheckpointError) as err:
        ck.load_checkpoint(old, _never)
    assert "rng.pt" in str(err.value) and "pickle" in str(err.value) and str(old) in str(err.value)
    assert ck.rng_extra(old) == {}  # rng.pt is not even opened
    assert not marker.exists()
    pickle.loads((old / "rng.pt").read_bytes())  # the control: loading it does run the payload
    assert marker.read_text() == "ran"


# ----------------------------------------------------------------------------- real Megatron checkpoints


@pytest.fixture(scope="module")
def real(tiny_moe, tmp_path_factory):
    """Two torchrun ranks (TP=2): a trainer checkpoint of a trained Megatron learner, a refused NaN save,
    and a bare torch_dist folder holding the NaN (tests/distributed/trainer_checkpoints.py)."""
    from megapo.launch.local import run_torchrun

    root = tmp_path_factory.mktemp("real_ckpt")
    spec = {"model": str(tiny_moe), "root": str(root / "checkpoints"), "nan_ckpt": str(root / "nan_ckpt"),
            "poisoned": POISONED}
    (root / "spec.json").write_text(json.dumps(spec))
    rc = run_torchrun([str(ROOT / "tests" / "distributed" / "trainer_checkpoints.py"), "--spec",
                       str(root / "spec.json"), "--out", str(root / "results.pt")], nproc=2, timeout_s=600)
    assert rc == 0
    return {"root": root, "ckpts": root / "checkpoints", "step": root / "checkpoints" / "step_00000001",
            "nan": root / "nan_ckpt", "results": torch.load(root / "results.pt"), "model": tiny_moe}


def test_distributed_save_verifies_loads_and_refuses_nonfinite_weights(real):
    res = real["results"]
    assert res["verify"] == [] and res["loaded_step"] == 1
    manifest = json.loads((real["step"] / ck.MANIFEST).read_text())
    assert manifest["ranks"] == 2
    assert {"learner/.metadata", "learner/common.pt", "learner/metadata.json", "rng.safetensors",
            "rng_rank1.safetensors", ck.STATE_FILE} <= set(manifest["files"])
    for name, entry in manifest["files"].items():  # each rank hashed its share; all of them right
        assert entry["sha256"] == hashlib.sha256((real["step"] / name).read_bytes()).hexdigest(), name
    # the NaN sat in rank 1's shard only; both ranks refused (none hung in the collective save)
    rank0, rank1 = res["nonfinite_messages"]
    assert POISONED in rank1 and "1 non-finite" in rank1, rank1
    assert "another rank" in rank0, rank0
    assert not (real["ckpts"] / "step_00000002").exists()


def _copy(real, tmp_path, name="step_00000001") -> Path:
    dst = tmp_path / "checkpoints" / name
    shutil.copytree(real["step"], dst)
    return dst


def _truncate(path: Path, keep: int | None = None) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2 if keep is None else keep])


def _biggest_shard(step: Path) -> str:
    return max((str(p.relative_to(step)) for p in (step / "learner").glob("*.distcp")),
               key=lambda n: (step / n).stat().st_size)


# (case, damage(step folder) -> the file it hit, words the message must hold)
DAMAGE = {
    "missing shard": (lambda s: _unlink(s, _biggest_shard(s)), ["is missing", "shard"]),
    "missing metadata": (lambda s: _unlink(s, "learner/.metadata"), ["is missing", "torch_dist metadata"]),
    "missing metadata.json": (lambda s: _unlink(s, "learner/metadata.json"), ["is missing"]),
    "truncated shard": (lambda s: _cut(s, _biggest_shard(s)), ["truncated", "shard"]),
    "truncated trainer_state.json": (lambda s: _cut(s, ck.STATE_FILE), ["truncated", "step and data cursor"]),
    "truncated rng state": (lambda s: _cut(s, "rng.safetensors"), ["truncated", "RNG state"]),
    "missing rng state": (lambda s: _unlink(s, "rng.safetensors"), ["is missing", "samples differently"]),
    "missing rank-1 rng state": (lambda s: _unlink(s, "rng_rank1.safetensors"), ["is missing", "RNG state"]),
    "flipped byte in a shard": (lambda s: _flip(s, _biggest_shard(s)), ["sha256", "corrupted"]),
    "truncated manifest": (lambda s: _cut(s, ck.MANIFEST), ["manifest.json is unreadable"]),
}


def _unlink(step: Path, name: str) -> str:
    (step / name).unlink()
    return name


def _cut(step: Path, name: str) -> str:
    _truncate(step / name)
    return name


def _flip(step: Path, name: str) -> str:
    data = bytearray((step / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (step / name).write_bytes(bytes(data))
    return name


@pytest.mark.parametrize("case", DAMAGE)
def test_damaged_checkpoint_is_named_and_not_loaded(real, tmp_path, case):
    step = _copy(real, tmp_path)
    damage, words = DAMAGE[case]
    hit = damage(step)
    with pytest.raises(ck.CheckpointError) as err:
        ck.load_checkpoint(step, _never, model_dir=real["model"])
    text = str(err.value)
    assert text.startswith("--resume: cannot resume from " + str(step)), text
    if hit != ck.MANIFEST:
        assert hit in text, text
    for word in words:
        assert word in text, (word, text)
    assert "No earlier checkpoint" in text  # nothing to fall back to in this folder


def test_damaged_newest_offers_the_newest_earlier_checkpoint_that_verifies(real, tmp_path):
    good = _copy(real, tmp_path, "step_00000001")
    bad_earlier = _copy(real, tmp_path, "step_00000002")
    newest = _copy(real, tmp_path, "step_00000003")
    _cut(bad_earlier, "rng.safetensors")
    _unlink(newest, _biggest_shard(newest))
    assert ck.latest_checkpoint(tmp_path / "checkpoints") == newest
    with pytest.raises(ck.CheckpointError) as err:
        ck.load_checkpoint(newest, _never, model_dir=real["model"])
    text = str(err.value)
    assert f"The newest earlier checkpoint that verifies is {good}:" in text, text
    assert f"mv {newest} {newest}.damaged" in text
    # taking the advice: the damaged folder is no longer a checkpoint, the good one is found
    os.rename(newest, f"{newest}.damaged")
    os.rename(bad_earlier, f"{bad_earlier}.damaged")
    assert ck.latest_checkpoint(tmp_path / "checkpoints") == good
    assert ck.verify_checkpoint(good, real["model"]) == []


def test_checkpoint_of_another_model_is_refused(real, tmp_path, tiny_model_factory):
    step = _copy(real, tmp_path)
    deeper = tiny_model_factory("qwen3_moe", layers=3)
    with pytest.raises(ck.CheckpointError) as err:
        ck.load_checkpoint(step, _never, model_dir=deeper)
    text = str(err.value)
    assert "another model" in text and str(deeper) in text, text
    assert "(2, " in text and "(3, " in text, text  # stacked layers: 2 in the checkpoint, 3 in the config
    assert ck.verify_checkpoint(step, real["model"]) == []  # the model it was trained from is fine


def _rewrite_manifest_entry(step: Path, name: str) -> None:
    """What an attacker would do: make the manifest agree with the file they planted."""
    manifest = json.loads((step / ck.MANIFEST).read_text())
    data = (step / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step / ck.MANIFEST).write_text(json.dumps(manifest))


def test_hostile_torch_dist_metadata_is_never_unpickled(real, tmp_path):
    """learner/.metadata is the pickle Megatron loads unrestricted: a planted one (manifest updated to
    match) is refused before the learner loads, by the trainer and by the converter."""
    step = _copy(real, tmp_path)
    marker = tmp_path / "payload_ran"
    (step / "learner" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _rewrite_manifest_entry(step, "learner/.metadata")
    with pytest.raises(ck.CheckpointError) as err:
        ck.load_checkpoint(step, _never, model_dir=real["model"])
    assert "learner/.metadata" in str(err.value) and "pathlib" in str(err.value), str(err.value)
    convert = subprocess.run([sys.executable, "-m", "megapo.cli", "convert", "megatron-to-hf", "--ckpt", str(step),
                              "--model", str(real["model"]), "--out", str(tmp_path / "hf")], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert convert.returncode == 2, convert.stderr
    assert ".metadata" in convert.stderr and "Traceback" not in convert.stderr, convert.stderr
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_megatron_to_hf_refuses_nonfinite_weights(real, tmp_path):
    out = tmp_path / "hf"
    res = subprocess.run([sys.executable, "-m", "megapo.cli", "convert", "megatron-to-hf", "--ckpt", str(real["nan"]),
                          "--model", str(real["model"]), "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    text = res.stdout + res.stderr
    assert res.returncode != 0, text
    assert POISONED in text and "non-finite" in text, text[-3000:]
    assert not out.exists() and not any(p.name.startswith("hf.tmp") for p in tmp_path.iterdir())
