"""HF <-> Megatron name/shape mapping: registry by model_type, QKV interleave and gate/up shards vs
loops written out here, and every tensor of each tiny checkpoint covered by exactly one rule."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from megapo.config import ConfigError
from megapo.layout import read_hf_config
from megapo.models import family as fam


def test_family_chosen_by_model_type():
    assert fam.family_for({"model_type": "qwen3_moe"}).name == "qwen3_moe"
    assert fam.family_for({"model_type": "mixtral"}).name == "mixtral"
    assert fam.family_for({"model_type": "qwen2"}).name == "qwen2"
    with pytest.raises(ConfigError, match="'gpt_neox'"):
        fam.family_for({"model_type": "gpt_neox", "name_or_path": "qwen3_moe-like"})


def _spec(heads=4, kv=2, d=3):
    return fam.ModelSpec(family="x", vocab_size=10, hidden_size=5, num_layers=1, num_heads=heads, num_kv_heads=kv,
                         head_dim=d, ffn_hidden_size=4, norm_eps=1e-6, rope_theta=1e4, max_positions=8,
                         tied_embeddings=False)


def test_qkv_interleave_per_kv_group_matches_loop():
    spec = _spec()
    q, k, v = torch.randn(12, 5), torch.randn(6, 5), torch.randn(6, 5)
    rows = []
    for g in range(2):  # Megatron: per KV group, its q heads, then its k head, then its v head
        for h in range(2):
            rows.append(q[(g * 2 + h) * 3:(g * 2 + h + 1) * 3])
        rows.append(k[g * 3:(g + 1) * 3])
        rows.append(v[g * 3:(g + 1) * 3])
    assert torch.equal(fam.qkv_full(spec, q, k, v), torch.cat(rows))
    assert all(torch.equal(a, b) for a, b in zip(fam.qkv_split(spec, fam.qkv_full(spec, q, k, v)), (q, k, v)))
    qb, kb, vb = torch.randn(12), torch.randn(6), torch.randn(6)
    assert all(torch.equal(a, b) for a, b in zip(fam.qkv_split(spec, fam.qkv_full(spec, qb, kb, vb)), (qb, kb, vb)))
    # one buffer, q then k then v back to back (a weight sync sends them as one piece)
    sq, sk, sv = fam.qkv_split(spec, fam.qkv_full(spec, q, k, v))
    assert sq.untyped_storage().data_ptr() == sk.untyped_storage().data_ptr() == sv.untyped_storage().data_ptr()
    assert sk.data_ptr() == sq.data_ptr() + q.numel() * 4 and sv.data_ptr() == sk.data_ptr() + k.numel() * 4


def test_qkv_tp_shard_holds_whole_groups():
    spec = _spec()
    q, k, v = torch.randn(12, 5), torch.randn(6, 5), torch.randn(6, 5)
    rule = fam.Rule("qkv", ("q", "k", "v"))
    shard1 = fam.to_local(rule, spec, [q, k, v], dim=0, rank=1, size=2)
    assert torch.equal(shard1, torch.cat([q[6:12], k[3:6], v[3:6]]))  # group 1: heads 2,3 + k1 + v1
    shards = [fam.to_local(rule, spec, [q, k, v], dim=0, rank=r, size=2) for r in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(fam.from_shards(rule, spec, shards, dim=0), (q, k, v)))


def test_gate_up_shards_split_each_half():
    gate, up = torch.randn(8, 5), torch.randn(8, 5)
    rule = fam.Rule("gate_up", ("g", "u"))
    shards = [fam.to_local(rule, _spec(), [gate, up], dim=0, rank=r, size=2) for r in range(2)]
    assert torch.equal(shards[1], torch.cat([gate[4:], up[4:]]))
    g2, u2 = fam.from_shards(rule, _spec(), shards, dim=0)
    assert torch.equal(g2, gate) and torch.equal(u2, up)


def test_vocab_padding_added_then_stripped():
    spec = _spec()  # vocab 10
    emb = torch.randn(10, 5)
    rule = fam.Rule("vocab", ("e",))
    assert fam.padded_vocab(10, 4) == 12
    shards = [fam.to_local(rule, spec, [emb], dim=0, rank=r, size=4, vocab_rows=12) for r in range(4)]
    assert [s.shape[0] for s in shards] == [3, 3, 3, 3] and torch.equal(shards[3][1:], torch.zeros(2, 5))
    (back,) = fam.from_shards(rule, spec, shards, dim=0)
    assert torch.equal(back, emb)


def test_rope_theta_old_and_new_config_layouts():
    assert fam.rope_theta({"rope_theta": 5e5}) == 5e5
    assert fam.rope_theta({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}) == 1e6
    with pytest.raises(ConfigError, match="yarn"):
        fam.rope_theta({"rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn"}})


@pytest.mark.parametrize("family_name", ["qwen3_moe", "qwen2", "mixtral"])
def test_rules_cover_every_checkpoint_tensor_once(tiny_model_factory, family_name):
    model_dir = tiny_model_factory(family_name)
    hf = read_hf_config(model_dir)
    family = fam.family_for(hf)
    spec = family.spec(hf)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        on_disk = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    named = []
    for rule in family.global_rules.values():
        if rule.kind == "vocab" and spec.tied_embeddings and "lm_head" in rule.hf[0]:
            continue
        named += list(rule.hf)
    for layer in range(spec.num_layers):
        for suffix, rule in family.layer_rules.items():
            if suffix.endswith(".bias") and not spec.qkv_bias:
                continue
            named += [n.format(L=layer) for n in rule.hf]
        for e in range(spec.num_experts):
            for rule in family.expert_rules.values():
                named += [n.format(L=layer, E=e) for n in rule.hf]
    assert len(named) == len(set(named))
    assert set(named) == set(on_disk)
    # shapes: a QKV rule's three tensors have head_dim * (heads, kv, kv) rows
    q = on_disk["model.layers.0.self_attn.q_proj.weight"]
    assert q[0] == spec.num_heads * spec.head_dim


@pytest.mark.parametrize("kind, names, dim", [("copy", ("a",), 0), ("copy", ("a",), 1), ("vocab", ("e",), 0),
                                              ("gate_up", ("g", "u"), 0), ("qkv", ("q", "k", "v"), 0)])
def test_reading_only_the_shard_equals_slicing_the_full_tensor(kind, names, dim):
    spec = _spec(heads=8, kv=4, d=2)  # vocab 10
    full = {"a": torch.randn(8, 12), "e": torch.randn(10, 5), "g": torch.randn(8, 5), "u": torch.randn(8, 5),
            "q": torch.randn(16, 5), "k": torch.randn(8, 5), "v": torch.randn(8, 5)}
    reads = []

    def read(name, d, start, stop):
        reads.append((name, d, start, stop))
        t = full[name]
        return t if d is None else t.narrow(d, start, stop - start)

    rule = fam.Rule(kind, names)
    for size in (1, 2, 4):
        for rank in range(size):
            expected = fam.to_local(rule, spec, [full[n] for n in names], dim=dim, rank=rank, size=size, vocab_rows=12)
            got = fam.read_local(rule, spec, list(names), read, lambda n: list(full[n].shape), dim=dim, rank=rank,
                                 size=size, vocab_rows=12)
            assert torch.equal(got, expected), (size, rank)
    assert any(r[1] is not None for r in reads)  # shards were read as slices
