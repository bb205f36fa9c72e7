"""Attention-entropy token reweighting (Li, Wu, Bao and Wu 2026, Not All Tokens Learn Alike: Attention Entropy Reveals
Heterogeneous Signals in RL Reasoning, arXiv:2605.07660), the stage attention_entropy and its input
Learner.response_attention_entropy:
- the entropies against transformers' eager attention (output_attentions=True) on the same tiny models, written out
  here (head-averaged distribution, −Σ ā log ā at the queries predicting the response): TP=1 with packed rows and
  shared prompts, TP=2 (sequence parallel), PP=2 and DP=2 (world 2 under torchrun), first and last layer;
- the weights as plain loops (normalised entropy, average ranks, the annealed tilt), the stage's advantages, the
  loop's one pass on the replayed routes, split invariance and float64 finite differences of PPO on them;
- refusals naming the field (options; layer out of range; attention kinds the recording cannot read);
- the registry and the stability bench's variant; `megapo train` with the stage on.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megapo.algorithms.attention_entropy import AttentionEntropyOptions, attention_entropy_weights
from megapo.algorithms.sample import TrainSample
from megapo.config import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layout_runs import run_layout_script  # noqa: E402
from algorithm_configs import make_cfg  # noqa: E402
from objective_loops import assert_ppo_gradient_matches_fd, assert_ppo_split_invariant  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "distributed" / "attention_entropy_layouts.py"
LAYERS = [0, -1]


# ----------------------------------------------------------------------------- the entropies vs transformers


def entropy_batch(vocab: int = 512, seed: int = 0) -> list[dict]:
    """Three responses to one prompt (shared where sharing is on) and two other sequences, of several lengths."""
    rng = random.Random(seed)
    prompt = [rng.randrange(vocab) for _ in range(6)]
    batch = [dict(tokens=prompt + [rng.randrange(vocab) for _ in range(n)], prompt_len=6) for n in (5, 9, 2)]
    for n, p in ((11, 4), (7, 1)):
        batch.append(dict(tokens=[rng.randrange(vocab) for _ in range(n)], prompt_len=p))
    return batch


def hf_attention_entropy(model_dir, batch: list[dict], layer: int) -> list[torch.Tensor]:
    """Per sample, at the queries prompt_len-1 .. len-2: −Σ_j ā_j log ā_j, ā the mean over heads of transformers'
    eager attention probabilities at `layer`, written out as loops over the keys."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation="eager")
    out = []
    with torch.no_grad():
        for s in batch:
            att = model(torch.tensor([s["tokens"]]), output_attentions=True).attentions[layer][0].double()
            heads = att.shape[0]
            row = []
            for q in range(s["prompt_len"] - 1, len(s["tokens"]) - 1):
                h = 0.0
                for j in range(q + 1):  # the keys a causal query sees
                    a = sum(float(att[k, q, j]) for k in range(heads)) / heads
                    h -= a * math.log(a) if a > 0 else 0.0
                row.append(h)
            out.append(torch.tensor(row, dtype=torch.float64))
    return out


RUNS = {
    1: [dict(name="tp1/rows/shared", layout=dict(tp=1, pp=1, ep=1, dp=1), micro_batch_tokens=48, row_tokens=24,
             share_prefix="auto"),
        dict(name="tp1/one_per_row", layout=dict(tp=1, pp=1, ep=1, dp=1), micro_batch_tokens=16, row_tokens=1,
             share_prefix="off")],
    2: [dict(name="tp2/rows/shared", layout=dict(tp=2, pp=1, ep=1, dp=1), micro_batch_tokens=48, row_tokens=24,
             share_prefix="auto"),
        dict(name="pp2/rows/shared", layout=dict(tp=1, pp=2, ep=1, dp=1), micro_batch_tokens=24, row_tokens=24,
             share_prefix="auto"),
        dict(name="dp2/one_per_row", layout=dict(tp=1, pp=1, ep=1, dp=2), micro_batch_tokens=16, row_tokens=1,
             share_prefix="off")],
}


@pytest.fixture(scope="module")
def entropy_runs(tiny_dense, tmp_path_factory):

    tmp = tmp_path_factory.mktemp("attention_entropy")
    batch = entropy_batch()
    results = {}
    for world, runs in RUNS.items():
        spec = dict(runs=[dict(r, model=str(tiny_dense)) for r in runs], batch=batch, layers=LAYERS)
        saved = run_layout_script(SCRIPT, spec, world, tmp)
        results.update(saved)
    return dict(results=results, batch=batch, model=tiny_dense)


@pytest.mark.parametrize("layer", LAYERS)
def test_entropies_match_transformers_eager_attention_in_every_layout(entropy_runs, layer):
    """Learner.response_attention_entropy equals the head-averaged attention entropy of transformers' eager forward
    (1e-6) under TP=1 (packed rows with a shared prompt; one sequence per row), TP=2 with sequence parallel (heads
    split: their sum all-reduced), PP=2 (the layer on one stage) and DP=2."""
    ref = hf_attention_entropy(entropy_runs["model"], entropy_runs["batch"], layer)
    results = entropy_runs["results"]
    assert sorted(results) == sorted(r["name"] for runs in RUNS.values() for r in runs)
    assert results["tp1/rows/shared"]["packed_tokens"] < sum(len(s["tokens"]) for s in entropy_runs["batch"])
    for name, got in results.items():
        assert [g.shape for g in got[layer]] == [r.shape for r in ref], name
        for g, r in zip(got[layer], ref):
            assert g.dtype == torch.float64
            err = (g - r).abs().max().item()
            assert err < 1e-6, f"{name}, layer {layer}: max |H - transformers| = {err:.2e}"


def test_the_recording_hook_is_set_only_for_the_pass():
    """The default attention path carries no hook: response_attention_entropy registers one on the chosen layer's
    core attention and removes it after its pass (also when the pass fails)."""
    from megapo.learner import attention_entropy as ae

    class Core(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return None

    core = Core()
    block = SimpleNamespace(layer_number=2, self_attention=SimpleNamespace(core_attention=core))
    spec = SimpleNamespace(num_layers=2, num_heads=2, mla=None, attention_sinks=False, sliding_window=0,
                           window_layers=(), vocab_size=8)
    learner = SimpleNamespace(spec=spec, backend=SimpleNamespace(use_te=False), route_hook=None,
                              module=SimpleNamespace(decoder=SimpleNamespace(layers=[block])))

    def failing_pass(*args):
        assert len(core._forward_hooks) == 1
        raise RuntimeError("boom")

    original = ae._forward_responses
    ae._forward_responses = failing_pass
    try:
        with pytest.raises(RuntimeError, match="boom"):
            ae.response_attention_entropy(learner, [[1, 2, 3]], np.array([3]), [1], layer=-1)
    finally:
        ae._forward_responses = original
    assert not core._forward_hooks


# ----------------------------------------------------------------------------- the weights as loops


def ref_weights(entropies, prompt_lens, masks, step, o: AttentionEntropyOptions):
    """The stage's formula written out: normalised entropies, 1-based average ranks over the policy tokens, the
    annealed tilt, w = 1 + β·(2r − T − 1)/(T − 1); 1 outside the loss mask."""
    scores = []  # (sample, token, h)
    for i, (row, p) in enumerate(zip(entropies, prompt_lens)):
        for t, h in enumerate(row):
            if masks is not None and masks[i] is not None and not masks[i][t]:
                continue
            keys = p + t
            scores.append((i, t, (h / math.log(keys) if keys > 1 else 0.0) if o.normalize else h))
    total = len(scores)
    if o.anneal_steps == 0:
        beta = o.beta_end
    else:
        beta = o.beta_start + (o.beta_end - o.beta_start) * min(step / o.anneal_steps, 1.0)
    out = [[1.0] * len(row) for row in entropies]
    for i, t, h in scores:
        below = sum(1 for _, _, x in scores if x < h)
        equal = sum(1 for _, _, x in scores if x == h)
        rank = below + (equal + 1) / 2
        u = (2 * rank - total - 1) / (total - 1) if total > 1 else 0.0
        out[i][t] = 1 + beta * u
    return out, beta


def make_entropies(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(n, generator=g, dtype=torch.float64) * 3).tolist() for n in lengths]


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("step", [0, 30, 100, 250])
@pytest.mark.parametrize("masked", [False, True])
def test_weights_match_the_formula_written_out(normalize, step, masked):
    ent = make_entropies(1, (4, 6, 1, 5))
    ent[1][2] = ent[0][1] = 0.75  # a tie across samples (normalised differently unless normalize is off)
    prompt_lens = [3, 1, 5, 2]
    masks = [[1, 0, 1, 1], None, [1], [0, 1, 1, 1, 0]] if masked else None
    o = AttentionEntropyOptions(normalize=normalize, beta_start=-0.6, beta_end=0.4, anneal_steps=200)
    got, metrics = attention_entropy_weights([torch.tensor(e) for e in ent], prompt_lens, masks, step, o)
    want, beta = ref_weights(ent, prompt_lens, masks, step, o)
    assert metrics["attention_entropy/beta"] == pytest.approx(beta, abs=1e-15)
    for g, w in zip(got, want):
        assert g.tolist() == pytest.approx(w, abs=1e-12)
    policy = [w for i, row in enumerate(got) for t, w in enumerate(row.tolist())
              if masks is None or masks[i] is None or masks[i][t]]
    assert sum(policy) / len(policy) == pytest.approx(1.0, abs=1e-12)  # mean 1 over the policy tokens


def test_ties_weigh_alike_and_the_tilt_moves_from_anchors_to_explorers():
    o = AttentionEntropyOptions(normalize=False, beta_start=-0.5, beta_end=0.5, anneal_steps=10)
    ent = [torch.tensor([0.1, 2.0, 0.1, 1.0])]
    early, _ = attention_entropy_weights(ent, [1], None, 0, o)
    late, _ = attention_entropy_weights(ent, [1], None, 10, o)
    assert early[0][0] == early[0][2] and early[0][0] > early[0][3] > early[0][1]  # anchors up
    assert late[0][0] == late[0][2] and late[0][0] < late[0][3] < late[0][1]  # explorers up
    (one,), _ = attention_entropy_weights([torch.tensor([0.3])], [2], None, 0, o)
    assert one.tolist() == [1.0]


def test_the_stage_multiplies_the_advantages_and_keeps_per_token_ones():
    from megapo.algorithms.pipeline import TokenContext, parse_stages, run_token_stages

    ent = make_entropies(2, (3, 2))
    batch = [TrainSample([1, 2, 3, 4, 5], 2, 0.5), TrainSample([1, 2, 3, 4], 2, [0.2, -0.4])]
    ctx = TokenContext(group_size=2, step=7, seed=0, kl_coef=0.0, attention_entropy=[torch.tensor(e) for e in ent])
    metrics = run_token_stages(parse_stages([{"name": "attention_entropy", "anneal_steps": 20}]), batch, ctx)
    want, beta = ref_weights(ent, [2, 2], None, 7, AttentionEntropyOptions(anneal_steps=20))
    assert batch[0].advantage == pytest.approx([0.5 * w for w in want[0]], abs=1e-12)
    assert batch[1].advantage == pytest.approx([0.2 * want[1][0], -0.4 * want[1][1]], abs=1e-12)
    assert metrics["attention_entropy/beta"] == pytest.approx(beta)
    ctx = TokenContext(group_size=2, step=0, seed=0, kl_coef=0.0)
    with pytest.raises(ValueError, match="^old_attention_entropy: stage attention_entropy"):
        run_token_stages(parse_stages([{"name": "attention_entropy"}]), batch, ctx)


def test_the_loop_takes_one_entropy_pass_at_the_stage_layer_on_the_replayed_routes():
    from megapo.trainer.metrics import StepTimer
    from megapo.trainer.update import advantage_stages

    ent = make_entropies(3, (3, 4, 2, 5))
    adv = [0.5, -0.5, -0.5, 0.5]
    batch = [TrainSample([1, 2] + [3] * len(e), 2, a, old_logp=[-1.0] * len(e), routes=f"routes{i}")
             for i, (e, a) in enumerate(zip(ent, adv))]
    calls = []

    class EntropyLearner:
        def response_attention_entropy(self, sequences, prompt_lens, layer=-1, routes=None):
            calls.append((sequences, prompt_lens, layer, routes))
            return [torch.tensor(e, dtype=torch.float64) for e in ent]

    groups = [SimpleNamespace(rewards=[1.0, 0.0], samples=[None, None], privileged=False),
              SimpleNamespace(rewards=[0.0, 1.0], samples=[None, None], privileged=False)]
    cfg = make_cfg(stages=[{"name": "attention_entropy", "layer": 1}], n_samples=2)
    metrics = advantage_stages(EntropyLearner(), batch, groups, cfg, 40, None, StepTimer())
    assert calls == [([s.tokens for s in batch], [2] * 4, 1, [f"routes{i}" for i in range(4)])]
    want, _ = ref_weights(ent, [2] * 4, None, 40, AttentionEntropyOptions(layer=1))
    for s, a, w in zip(batch, adv, want):
        assert s.advantage == pytest.approx([a * x for x in w], abs=1e-12)
    assert "attention_entropy/anchor_weight" in metrics


def test_ppo_on_the_stage_advantages_is_split_invariant_and_its_gradient_matches_finite_differences():
    """The ranks are taken once over the whole batch, before the split: PPO's loss and gradient on the reweighted
    advantages over 2 DP ranks x 4 micro-batches equal the one-batch ones (1e-12), and that gradient equals float64
    finite differences."""
    lengths = (4, 6, 3, 5, 2, 6, 4, 3)
    ent = make_entropies(6, lengths)
    adv = [0.9, -0.3, -0.3, 0.9, -0.6, 0.2, 0.9, -0.3]
    weights, _ = attention_entropy_weights([torch.tensor(e) for e in ent], [3] * 8, None, 0, AttentionEntropyOptions())
    g = torch.Generator().manual_seed(5)
    old = [(-torch.rand(n, generator=g, dtype=torch.float64) * 2 - 0.1).tolist() for n in lengths]
    per_token = [(a * w).tolist() for a, w in zip(adv, weights)]
    assert_ppo_split_invariant(old, per_token, list(lengths), seed=7)
    assert_ppo_gradient_matches_fd(old, per_token, list(lengths), seed=9)


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("option, value", [("layer", 1.5), ("layer", True), ("anneal_steps", -1),
                                           ("anneal_steps", 2.0), ("beta_start", 1.5), ("beta_end", float("nan")),
                                           ("beta_end", "x"), ("normalize", "yes")])
def test_options_refused_naming_the_field(option, value):
    with pytest.raises(ConfigError) as err:
        make_cfg(stages=[{"name": "attention_entropy", option: value}])
    assert err.value.field == f"algorithm.stages[0].{option}"


def _spec(**kw):
    base = dict(num_layers=4, num_heads=4, mla=None, attention_sinks=False, sliding_window=0, window_layers=())
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("kw, use_te, words", [
    ({}, True, "Transformer Engine"), ({"mla": object()}, False, "multi-latent"),
    ({"attention_sinks": True}, False, "sinks"), ({"sliding_window": 8}, False, "sliding-window"),
    ({"sliding_window": 8, "window_layers": (True, False, True, True)}, False, "sliding-window")])
def test_attention_kinds_it_cannot_read_are_refused_naming_why(kw, use_te, words):
    from megapo.learner.attention_entropy import attention_kind_error, check_attention_kind

    why = attention_kind_error(_spec(**kw), -1, use_te)
    assert words in why
    with pytest.raises(ValueError, match=f"^layer: attention entropies cannot be read: .*{words}"):
        check_attention_kind(_spec(**kw), -1, use_te, "layer")
    # a full-attention layer of a model whose other layers slide is readable
    assert attention_kind_error(_spec(sliding_window=8, window_layers=(True, False, True, True)), 1, False) is None


def test_run_config_refuses_a_layer_out_of_range_and_an_unreadable_kind(tiny_dense, monkeypatch):
    """At config time (trainer.config._check_model): the stage's layer must be one of the model's, naming
    algorithm.stages[i].layer; on a machine whose learner would run TE's fused attention the stage is refused naming
    algorithm.stages[i] and the reason."""
    from megapo.config import from_dict
    from megapo.learner import backend
    from megapo.trainer.config import RunConfig, _check_model

    from algorithm_configs import config_data

    def cfg_with(stage):
        data = config_data(stages=[{"name": "erpo"}, stage])
        data.setdefault("model", {})["path"] = str(tiny_dense)
        return from_dict(RunConfig, data)

    layers = json.loads((Path(tiny_dense) / "config.json").read_text())["num_hidden_layers"]
    with pytest.raises(ConfigError) as err:
        _check_model(cfg_with({"name": "attention_entropy", "layer": layers}))
    assert err.value.field == "algorithm.stages[1].layer" and "not one of the model's" in str(err.value)
    _check_model(cfg_with({"name": "attention_entropy", "layer": -layers}))
    monkeypatch.setattr(backend, "detect_backend", lambda: backend.Backend("cuda", "nccl", True))
    with pytest.raises(ConfigError) as err:
        _check_model(cfg_with({"name": "attention_entropy"}))
    assert err.value.field == "algorithm.stages[1]" and "Transformer Engine" in str(err.value)


# ----------------------------------------------------------------------------- registry, bench, a run


def test_registered_with_its_paper_and_in_the_bench():
    from megapo.algorithms.pipeline import STAGES
    from megapo.algorithms.registry import entries
    from tools.bench import stability as st

    (entry,) = [e for e in entries("advantage_stage") if e.name == "attention_entropy"]
    assert "Not All Tokens Learn Alike" in entry.paper and "arXiv:2605.07660" in entry.paper
    assert "w_t = 1 + β(step)·u_t" in entry.formula and "Assumption:" in entry.formula
    assert STAGES["attention_entropy"].inputs == ("old_attention_entropy", "step")
    assert "attention_entropy" in st.variant_names("attention_entropy")


def test_train_two_steps(tmp_path, tiny_moe):
    """`megapo train` with the stage on ppo: the learner's attention-entropy pass on the tiny MoE, both steps update
    with a finite loss and log the stage's metrics."""
    from train_runs import train_rows

    rows = train_rows(tmp_path, "attention_entropy", f"model.path={tiny_moe}", "train.steps=2",
                      "data.prompts_per_step=4", "rollout.n_samples=4", "algorithm.objective=ppo",
                      "algorithm.stages=[{name: attention_entropy, anneal_steps: 2}]")
    assert len(rows) == 2
    assert all(math.isfinite(r["train/loss"]) and r["train/skipped_nonfinite"] == 0 for r in rows)
    assert [r["attention_entropy/beta"] for r in rows] == pytest.approx([0.0, 0.5])  # trainer steps 1 and 2
    assert all(r["attention_entropy/mean"] > 0 for r in rows)
