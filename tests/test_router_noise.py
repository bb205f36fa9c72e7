"""rollout.router_noise (issue 30): N(0, σ²) on the embedded engine's router logits, before its top-k.

References, none of them the engine's own code:
- transformers' forward of each sample with the same noise added to its routers' logits (torch's F.linear
  patched for the router weights only), its own routers then choosing the experts and gates: the engine's
  routes must be that forward's choice and its log-probs that forward's. The noise is drawn again here from
  the protocol the engine documents (megapo/engines/embedded.py: one prefill block, then one block per decode
  step for every row of the batch), from a generator seeded as the engine's.
- with σ = 0 the engine is the engine of before (the same samples as one built without the option), and
  the noise-free reference forward above gives its routes.
- `megapo train` (the issue's done-when): router/disagree rises with σ, and under R3 the learner trains on the
  noisy routes exactly (train/replay/disagree_post 0).
- the config refuses σ > 0 for engines that cannot apply it (capabilities), on dense models, and σ < 0.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from family_checks import TOL, engine_model, hf_model, routers, same_sets  # noqa: E402
from train_runs import train_rows  # noqa: E402

from megapo.config import ConfigError, load_config  # noqa: E402
from megapo.engines.base import SamplingParams  # noqa: E402
from megapo.engines.embedded import EmbeddedEngine, router_noise_generator  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
N, MAX_NEW, SEED = 2, 10, 3
STOP = tuple(range(0, 512, 9))  # about one token in nine ends a sample: rows leave the batch at different steps


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory, tmp_path_factory):
    written = {}

    def get(name: str):
        if name not in written:
            written[name] = (tiny_model_factory("qwen3_moe") if name == "qwen3_moe"
                             else engine_model(name, tiny_model_factory, tmp_path_factory))
        return written[name]

    return get


def redrawn_noise(seed: int, sigma: float, prompts, n: int, max_new: int, layers: int, experts: int):
    """noise(u, j, outputs) -> [len(prompt u) + outputs, layers, experts]: the noise of sample j of prompt u at
    every position transformers' forward of prompt + outputs feeds (its last row, never fed to the engine: 0)."""
    gen = router_noise_generator(seed)
    U, P, B = len(prompts), max(map(len, prompts)), len(prompts) * n
    prefill = sigma * torch.randn(U, P, layers, experts, generator=gen)
    steps = [sigma * torch.randn(B, 1, layers, experts, generator=gen)[:, 0] for _ in range(max_new - 1)]

    def noise(u: int, j: int, outputs: int) -> torch.Tensor:
        fed = [prefill[u, P - len(prompts[u]):]] + [steps[t][u * n + j][None] for t in range(outputs - 1)]
        return torch.cat(fed + [torch.zeros(1, layers, experts)])

    return noise


def hf_with_noise(hf, tokens: list[int], noise: torch.Tensor):
    """transformers' log p(tokens[t] | tokens[:t]) (t >= 1) and its routers' choice [len - 1, layers, k] with
    noise[:, layer] ([len(tokens), layers, experts]) added to each router's logits."""
    layer_of = {r.weight.data_ptr(): i for i, r in enumerate(routers(hf))}
    linear, chosen = F.linear, {}

    def noisy_linear(x, weight, bias=None):
        out = linear(x, weight, bias)
        layer = layer_of.get(weight.data_ptr())
        return out if layer is None else out + noise[:, layer].reshape(out.shape).to(out.dtype)

    handles = [r.register_forward_hook(lambda m, a, out, i=i: chosen.__setitem__(i, out[2].detach()))
               for i, r in enumerate(routers(hf))]
    F.linear = noisy_linear
    try:
        with torch.no_grad():
            logits = hf(torch.tensor([tokens])).logits[0].float()
    finally:
        F.linear = linear
        for h in handles:
            h.remove()
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return logp, torch.stack([chosen[i] for i in range(len(chosen))], dim=1)[:-1]


def generate(model_dir, sigma: float, seed: int = 0, **params):
    engine = EmbeddedEngine(model_dir, seed=seed, router_noise=sigma)
    return engine, engine.generate(PROMPTS, SamplingParams(n=N, max_new_tokens=MAX_NEW, stop_token_ids=STOP,
                                                           return_routes=True, **params))


def check_against_transformers(model_dir, sigma: float, noise_seed: int, params: dict):
    """Every sample of a batch against transformers' forward with the re-drawn noise; returns the fraction of
    (position, layer) routes that differ from transformers' noise-free choice on the same tokens."""
    engine, groups = generate(model_dir, sigma, **params)
    hf, spec = hf_model(model_dir), engine.spec
    noise = redrawn_noise(noise_seed, sigma, PROMPTS, N, MAX_NEW, spec.num_moe_layers, spec.experts)
    moved, decisions = 0, 0
    lengths = set()
    for u, group in enumerate(groups):
        for j, s in enumerate(group):
            tokens = s.prompt_ids + s.output_ids
            lengths.add(len(s.output_ids))
            logp, chosen = hf_with_noise(hf, tokens, noise(u, j, len(s.output_ids)))
            assert s.routes.shape == tuple(chosen.shape)
            assert same_sets(s.routes, chosen).all(), f"prompt {u} sample {j}: routes are not the noisy choice"
            err = (torch.tensor(s.logprobs) - logp[len(s.prompt_ids) - 1:]).abs().max().item()
            assert err < TOL, f"prompt {u} sample {j}: max |engine - transformers with the noise| = {err:.2e}"
            _, free = hf_with_noise(hf, tokens, torch.zeros(len(tokens), spec.num_moe_layers, spec.experts))
            moved += int((~same_sets(s.routes, free)).sum())
            decisions += s.routes.shape[0] * s.routes.shape[1]
    assert len(lengths) > 1  # some samples stopped early: the decode batch shrank on the way
    return moved / decisions


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_noisy_routes_logprobs_are_transformers_with_the_same_noise(model_dir, name):
    # the engine's own generator (seeded by its seed, 0), then a SamplingParams seed
    moved = check_against_transformers(model_dir(name), 0.05, 0, {})
    assert moved > 0.05  # the noise changed the experts used (and the reference saw it)
    check_against_transformers(model_dir(name), 0.05, 7, {"seed": 7})


def test_zero_noise_is_the_engine_of_before(model_dir):
    _, base = generate(model_dir("qwen3_moe"), 0.0, seed=5)
    engine = EmbeddedEngine(model_dir("qwen3_moe"), seed=5)  # built without the option
    plain = engine.generate(PROMPTS, SamplingParams(n=N, max_new_tokens=MAX_NEW, stop_token_ids=STOP,
                                                    return_routes=True))
    for g0, g1 in zip(base, plain):
        for a, b in zip(g0, g1):
            assert a.output_ids == b.output_ids and a.logprobs == b.logprobs and (a.routes == b.routes).all()
    hf, spec = hf_model(model_dir("qwen3_moe")), engine.spec
    for s in (s for g in base for s in g):
        tokens = s.prompt_ids + s.output_ids
        logp, chosen = hf_with_noise(hf, tokens, torch.zeros(len(tokens), spec.num_moe_layers, spec.experts))
        assert same_sets(s.routes, chosen).all()
        assert (torch.tensor(s.logprobs) - logp[len(s.prompt_ids) - 1:]).abs().max().item() < TOL
    # σ = 0 draws nothing: the checkpointed state is the sampler's alone, as before
    assert len(engine.rng_state()) == len(torch.Generator().get_state())


def test_noise_does_not_move_the_sampler_and_grows_with_sigma(model_dir):
    """The noise has a generator of its own (the sampler draws alike for every σ: a dose changes the routing
    only), and the share of routes that differ from transformers' noise-free choice grows with σ."""
    hf, shares, sampler = hf_model(model_dir("qwen3_moe")), [], []
    for sigma in (0.0, 0.01, 0.1):
        engine, groups = generate(model_dir("qwen3_moe"), sigma, seed=1)
        full = EmbeddedEngine(model_dir("qwen3_moe"), seed=1, router_noise=sigma)  # no stop: MAX_NEW draws each
        full.generate(PROMPTS, SamplingParams(n=N, max_new_tokens=MAX_NEW))
        sampler.append(full.rng_state()[:len(torch.Generator().get_state())])
        layers, experts = engine.spec.num_moe_layers, engine.spec.experts
        differ = []
        for s in (s for g in groups for s in g):
            tokens = s.prompt_ids + s.output_ids
            free = hf_with_noise(hf, tokens, torch.zeros(len(tokens), layers, experts))[1]
            differ.append(~same_sets(s.routes, free))
        shares.append(float(np.concatenate([d.reshape(-1) for d in differ]).mean()))
    assert all(torch.equal(sampler[0], state) for state in sampler[1:])
    assert not torch.equal(sampler[0], torch.Generator().manual_seed(1).get_state())  # it did draw
    assert shares[0] == 0.0 and shares[0] < shares[1] < shares[2], shares


def test_rng_state_carries_the_noise_generator(model_dir):
    """A resumed engine (its state set from a checkpoint) draws the same noise as the unstopped one."""
    params = SamplingParams(n=N, max_new_tokens=MAX_NEW, return_routes=True)
    a = EmbeddedEngine(model_dir("qwen3_moe"), seed=2, router_noise=0.05)
    a.generate(PROMPTS, params)
    state = a.rng_state().clone()
    assert len(state) == 2 * len(torch.Generator().get_state())
    want = a.generate(PROMPTS, params)
    b = EmbeddedEngine(model_dir("qwen3_moe"), seed=2, router_noise=0.05)
    b.set_rng_state(state)
    got = b.generate(PROMPTS, params)
    assert all(x.output_ids == y.output_ids and (x.routes == y.routes).all()
               for gx, gy in zip(want, got) for x, y in zip(gx, gy))
    c = EmbeddedEngine(model_dir("qwen3_moe"), seed=2, router_noise=0.05)  # only the sampler's state restored
    c.set_rng_state(state[:len(state) // 2])
    other = c.generate(PROMPTS, params)
    assert any((x.routes != y.routes).any() for gx, gy in zip(want, other) for x, y in zip(gx, gy) if
               x.routes.shape == y.routes.shape)
    with pytest.raises(ValueError, match="RNG state"):
        b.set_rng_state(state[:100])


def test_engine_refuses_a_bad_dose(model_dir, tiny_dense):
    with pytest.raises(ValueError, match="router_noise"):
        EmbeddedEngine(model_dir("qwen3_moe"), router_noise=-0.1)
    with pytest.raises(ValueError, match="no MoE layers"):
        EmbeddedEngine(tiny_dense, router_noise=0.1)
    EmbeddedEngine(tiny_dense, router_noise=0.0)


# ----------------------------------------------------------------------------- config


def _config(model, tmp_path, *overrides):
    from megapo.trainer.config import RunConfig

    items = [f"model.path={model}", "rollout.n_samples=4", "rollout.max_new_tokens=8", "data.task=addition",
             "data.max_prompt_tokens=16", "data.prompts_per_step=8", "train.steps=3",
             f"train.output_dir={tmp_path / 'run'}", *overrides]
    return load_config(RunConfig, None, items)


def test_config_refuses_engines_models_and_values_that_cannot_take_it(tiny_moe, tiny_dense, tmp_path):
    from megapo.engines.registry import capabilities, engine_names

    assert _config(tiny_moe, tmp_path, "rollout.router_noise=0.1").rollout.router_noise == 0.1
    assert _config(tiny_moe, tmp_path).rollout.router_noise == 0.0
    assert [n for n in engine_names() if capabilities(n).router_noise] == ["embedded"]
    for engine in ("vllm", "sglang"):
        extra = ["rollout.servers=[127.0.0.1:30000]"] if engine == "sglang" else []
        with pytest.raises(ConfigError) as err:
            _config(tiny_moe, tmp_path, f"rollout.engine={engine}", "rollout.weight_sync=disk",
                    "algorithm.routing_replay=off", "rollout.router_noise=0.1", *extra)
        assert err.value.field == "rollout.router_noise" and repr(engine) in str(err.value)
    _config(tiny_moe, tmp_path, "rollout.engine=vllm", "rollout.weight_sync=disk", "algorithm.routing_replay=off",
            "rollout.router_noise=0")  # 0 is off: any engine
    with pytest.raises(ConfigError) as err:
        _config(tiny_moe, tmp_path, "rollout.router_noise=-0.01")
    assert err.value.field == "rollout.router_noise"
    with pytest.raises(ConfigError) as err:
        _config(tiny_dense, tmp_path, "rollout.router_noise=0.1", "algorithm.routing_replay=off")
    assert err.value.field == "rollout.router_noise" and "dense" in str(err.value)


def test_a_router_of_servers_cannot_take_it():
    from megapo.engines.router import Router
    from megapo.engines.vllm import VLLMEngine

    assert not Router([VLLMEngine("http://127.0.0.1:1"), VLLMEngine("http://127.0.0.1:3")]).capabilities.router_noise


# ----------------------------------------------------------------------------- the done-when


def noise_rows(tmp_path, tiny_moe, sigma: float) -> list[dict]:
    return train_rows(tmp_path, f"run_{sigma}", f"rollout.router_noise={sigma}", "algorithm.routing_replay=r3",
                      "train.stability_metrics_every=1", "train.steps=2", f"model.path={tiny_moe}",
                      "data.prompts_per_step=8", "rollout.n_samples=4")


def test_train_router_disagree_rises_with_the_dose_and_r3_replays_it(tmp_path, tiny_moe):
    runs = {sigma: noise_rows(tmp_path, tiny_moe, sigma) for sigma in (0.0, 0.005, 0.05)}
    means = []
    for sigma, rows in runs.items():
        assert [r["step"] for r in rows] == [1, 2]
        for r in rows:
            assert r["train/replay/disagree_post"] == 0.0  # the learner trained on the engine's (noisy) routes
            assert r["train/replay/fallback_frac"] == 0.0
        means.append(np.mean([r["router/disagree"] for r in rows]))
    assert means[0] == 0.0 and means[0] < means[1] < means[2], means  # fp32 engine and learner: 0 without noise
    # R3 replays the experts, not the gates the noise also moved: the engine's log-probs are not the learner's
    assert max(r["mismatch/k3"] for r in runs[0.05]) > 100 * max(r["mismatch/k3"] for r in runs[0.0])
