"""The embedded engine against Hugging Face transformers (the independent reference) on tiny models."""

import numpy as np
import pytest
import torch
import transformers

from megapo.engines.base import SamplingParams
from megapo.engines.embedded import EmbeddedEngine
from megapo.engines.torch_lm import TorchCausalLM
from megapo.weights.safetensors_io import iter_folder

FAMILIES = ["qwen3_moe", "qwen2", "mixtral"]
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28]]


@pytest.fixture(scope="module")
def models(tiny_moe, tiny_dense, tiny_model_factory):
    return {"qwen3_moe": tiny_moe, "qwen2": tiny_dense, "mixtral": tiny_model_factory("mixtral")}


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_forward(hf, seq, moe):
    with torch.no_grad():
        out = hf(torch.tensor([seq]), output_router_logits=moe)
    routes = None
    if moe:  # HF router logits -> top-k expert ids per layer: [T, L, k]
        k = hf.config.num_experts_per_tok
        routes = torch.stack([torch.topk(r.float(), k, dim=-1).indices for r in out.router_logits], dim=1)
    return out.logits[0].float(), routes


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_matches_transformers(models, family):
    model = TorchCausalLM.from_pretrained(models[family])
    hf = hf_model(models[family])
    ids = torch.randint(0, 512, (3, 37), generator=torch.Generator().manual_seed(0))
    moe = family != "qwen2"
    with torch.no_grad():
        ref = hf(ids, output_router_logits=moe)
    if moe:
        logits, routes = model.logits(ids, with_routes=True)
        ref_routes = torch.stack([torch.topk(r.float(), 2, -1).indices.view(3, 37, 2) for r in ref.router_logits], 2)
        assert torch.equal(routes, ref_routes)
    else:
        logits = model.logits(ids)
    assert (logits - ref.logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_logprobs_and_routes_match_transformers(models, family):
    engine = EmbeddedEngine(models[family])
    hf = hf_model(models[family])
    moe = family != "qwen2"
    temperature = 0.7
    params = SamplingParams(n=2, temperature=temperature, top_p=0.9, max_new_tokens=10, seed=3, return_routes=moe)
    out = engine.generate(PROMPTS, params)
    assert [len(g) for g in out] == [2, 2, 2]
    for prompt, group in zip(PROMPTS, out):
        for s in group:
            assert s.prompt_ids == prompt and s.finish_reason == "length" and len(s.output_ids) == 10
            seq = prompt + s.output_ids
            logits, routes = hf_forward(hf, seq, moe)
            # log-prob of each sampled token under softmax(logits / temperature), written out here
            ref = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1:-1]
            ref = ref.gather(1, torch.tensor(s.output_ids)[:, None])[:, 0]
            assert np.allclose(s.logprobs, ref.numpy(), atol=1e-4)
            if moe:
                # every position fed to the model: all but the final sampled token
                assert s.routes.shape == (len(seq) - 1, 2, 2)
                assert np.array_equal(s.routes, routes[:-1].numpy())
            else:
                assert s.routes is None


def test_temperature_one_logprobs_are_policy_logprobs(tiny_moe):
    engine, hf = EmbeddedEngine(tiny_moe), hf_model(tiny_moe)
    [[s]] = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=8, seed=0))
    logits, _ = hf_forward(hf, PROMPTS[0] + s.output_ids, False)
    ref = torch.log_softmax(logits, -1)[len(PROMPTS[0]) - 1:-1].gather(1, torch.tensor(s.output_ids)[:, None])[:, 0]
    assert np.allclose(s.logprobs, ref.numpy(), atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_generate(models, family):
    engine, hf = EmbeddedEngine(models[family]), hf_model(models[family])
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=16))
    for prompt, [s] in zip(PROMPTS, out):
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                          eos_token_id=None, pad_token_id=0)
        assert s.output_ids == ref[0, len(prompt):].tolist()
        logits, _ = hf_forward(hf, prompt + s.output_ids, False)
        ref_lp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, torch.tensor(s.output_ids)[:, None])
        assert np.allclose(s.logprobs, ref_lp[:, 0].numpy(), atol=1e-4)


def test_stop_tokens_and_max_tokens(tiny_moe):
    engine = EmbeddedEngine(tiny_moe)
    params = SamplingParams(n=4, max_new_tokens=12, seed=7)
    free = engine.generate(PROMPTS, params)
    assert all(len(s.output_ids) == 12 and s.finish_reason == "length" for g in free for s in g)
    stop_id = free[0][0].output_ids[4]
    stopped = engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=12, seed=7, stop_token_ids=(stop_id,),
                                                      return_routes=True))
    n_stopped = 0
    for g_free, g_stop in zip(free, stopped):
        for a, b in zip(g_free, g_stop):  # same seed: identical until the first stop token
            if stop_id in a.output_ids:
                cut = a.output_ids.index(stop_id) + 1
                assert b.output_ids == a.output_ids[:cut] and b.finish_reason == "stop"
                assert np.allclose(b.logprobs, a.logprobs[:cut], atol=1e-5)
                n_stopped += 1
            else:
                assert b.output_ids == a.output_ids and b.finish_reason == "length"
            assert b.routes.shape == (len(b.prompt_ids) + len(b.output_ids) - 1, 2, 2)
    assert n_stopped >= 1


def test_batches_of_other_shapes_on_one_engine_match_fresh_engines(tiny_moe):
    """The engine keeps its KV cache between batches: a batch after a larger or smaller one (other prompt lengths,
    n, rows stopping at different steps) samples exactly what a fresh engine samples (fresh engines match
    transformers, above)."""
    engine = EmbeddedEngine(tiny_moe)
    batches = [(PROMPTS, 4, 12), ([[3, 4]], 2, 3), ([list(range(30, 50)), [7]], 6, 20)]
    finishes = set()
    for prompts, n, max_new in batches:
        free = SamplingParams(n=n, max_new_tokens=max_new, seed=n)
        stop = EmbeddedEngine(tiny_moe).generate(prompts, free)[0][0].output_ids[max_new // 2]  # some rows stop
        params = SamplingParams(n=n, max_new_tokens=max_new, seed=n, stop_token_ids=(stop,), return_routes=True)
        got, ref = engine.generate(prompts, params), EmbeddedEngine(tiny_moe).generate(prompts, params)
        for g, r in zip([s for grp in got for s in grp], [s for grp in ref for s in grp]):
            assert (g.output_ids, g.finish_reason, g.logprobs) == (r.output_ids, r.finish_reason, r.logprobs)
            assert np.array_equal(g.routes, r.routes)
            finishes.add((len(prompts), g.finish_reason))
    assert {(3, "stop"), (3, "length"), (2, "stop"), (2, "length")} <= finishes
    assert engine._cache.batch == 12 and engine._cache.max_len == 20 + 19  # grown to the largest batch seen


def test_seed_determinism(tiny_moe):
    a = EmbeddedEngine(tiny_moe).generate(PROMPTS, SamplingParams(n=3, max_new_tokens=8, seed=11))
    b = EmbeddedEngine(tiny_moe, seed=99).generate(PROMPTS, SamplingParams(n=3, max_new_tokens=8, seed=11))
    c = EmbeddedEngine(tiny_moe).generate(PROMPTS, SamplingParams(n=3, max_new_tokens=8, seed=12))
    ids = lambda out: [s.output_ids for g in out for s in g]  # noqa: E731
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)
    assert len({tuple(s.output_ids) for s in a[0]}) > 1  # the n samples of one prompt differ


def test_update_weights_changes_samples_and_version(tiny_moe, tiny_model_factory):
    other = tiny_model_factory("qwen3_moe", seed=1)
    engine = EmbeddedEngine(tiny_moe)
    params = SamplingParams(n=2, max_new_tokens=8, seed=0)
    before = engine.generate(PROMPTS, params)
    assert engine.weight_version == 0 and before[0][0].weight_version == 0
    engine.update_weights(iter_folder(other), version=3)
    after = engine.generate(PROMPTS, params)
    assert engine.weight_version == 3 and after[0][0].weight_version == 3
    assert [s.output_ids for g in after for s in g] != [s.output_ids for g in before for s in g]
    # log-probs now follow the new weights (HF forward of the other model)
    hf = hf_model(other)
    s = after[1][0]
    logits, _ = hf_forward(hf, s.prompt_ids + s.output_ids, False)
    ref = torch.log_softmax(logits, -1)[len(s.prompt_ids) - 1:-1].gather(1, torch.tensor(s.output_ids)[:, None])
    assert np.allclose(s.logprobs, ref[:, 0].numpy(), atol=1e-4)
    # transformers-5 in-memory names (fused experts) load too, and back from disk restores the first model
    engine.update_weights(hf_model(tiny_moe).state_dict().items(), version=4)
    assert [x.output_ids for g in engine.generate(PROMPTS, params) for x in g] == \
        [x.output_ids for g in before for x in g]
    engine.update_weights_from_disk(str(other), version=5)
    assert engine.weight_version == 5
    assert [x.output_ids for g in engine.generate(PROMPTS, params) for x in g] == \
        [x.output_ids for g in after for x in g]


def test_bad_input_errors(tiny_moe, tiny_dense):
    engine = EmbeddedEngine(tiny_moe)
    with pytest.raises(ValueError, match="prompts"):
        engine.generate([], SamplingParams())
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        engine.generate([[1], [100000]], SamplingParams())
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([[1]], SamplingParams(max_new_tokens=10**6))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(KeyError, match="model.layers.9"):
        engine.update_weights([("model.layers.9.mlp.gate.weight", torch.zeros(8, 64))], 1)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))], 1)
    with pytest.raises(ValueError, match="return_routes"):
        EmbeddedEngine(tiny_dense).generate([[1]], SamplingParams(return_routes=True))
    with pytest.raises(ValueError, match="logprobs"):
        EmbeddedEngine(tiny_moe, logprobs="bogus")


def test_pause_blocks_new_batches(tiny_moe):
    import threading

    engine = EmbeddedEngine(tiny_moe)
    engine.pause()
    done = threading.Event()
    t = threading.Thread(target=lambda: (engine.generate([[1, 2]], SamplingParams(max_new_tokens=2)), done.set()))
    t.start()
    assert not done.wait(0.3)
    engine.resume()
    assert done.wait(30)
    t.join()
    assert engine.health()
    engine.close()
    assert not engine.health()


def test_compute_dtype_follows_rollout_dtype(tiny_moe, tmp_path):
    """rollout.dtype sets the embedded engine's compute dtype (auto = float32): the weights are bfloat16 and the
    log-probs carry bfloat16 rounding (off transformers' float32 by more than a float32 engine ever is, and
    still within bfloat16's reach of them)."""
    from megapo.config import load_config
    from megapo.trainer.config import RunConfig
    from megapo.trainer.engine_setup import engine_from_config

    def engine_for(*overrides):
        cfg = load_config(RunConfig, None, [f"model.path={tiny_moe}", "data.task=addition", *overrides])
        return engine_from_config(cfg, tiny_moe, tmp_path)

    assert engine_for().model.embed.dtype == torch.float32
    assert engine_for("rollout.dtype=float16").model.embed.dtype == torch.float16
    engine = engine_for("rollout.dtype=bfloat16")
    assert all(t.dtype == torch.bfloat16 for t in engine.weight_buffers().values())
    [[s]] = engine.generate([PROMPTS[2]], SamplingParams(max_new_tokens=8, seed=0))
    logits, _ = hf_forward(hf_model(tiny_moe), PROMPTS[2] + s.output_ids, False)
    ref = torch.log_softmax(logits, -1)[len(PROMPTS[2]) - 1:-1].gather(1, torch.tensor(s.output_ids)[:, None])[:, 0]
    err = np.abs(np.array(s.logprobs) - ref.numpy()).max()
    assert 1e-4 < err < 2e-2, err


def test_auto_dtype_stays_bfloat16_for_a_vllm_server(tiny_moe):
    """rollout.dtype=auto (the default) is float32 only for the embedded engine: `megapo serve` on a config that
    leaves it out still starts vLLM in bfloat16."""
    import argparse

    from megapo.commands import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_intermixed_args(["megapo/configs/tiny_moe_addition.yaml", f"model.path={tiny_moe}",
                                         "rollout.engine=vllm", "algorithm.routing_replay=r2",
                                         "rollout.weight_sync=disk"])
    assert serve._served(args)["dtype"] == "bfloat16"


def test_samples_with_equal_prefixes_share_one_decode_row(tiny_moe):
    """A prompt's running samples whose tokens so far are equal are one state: each decode step computes one row
    per distinct (prompt, prefix) (counted here by a loop over the samples), and every sample's log-probs and
    routes still equal transformers' on its own sequence."""
    engine, hf = EmbeddedEngine(tiny_moe), hf_model(tiny_moe)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0]]  # equal prompts of different places: states of their own
    temperature = 0.03  # peaked: samples of one prompt often draw the same tokens
    params = SamplingParams(n=6, temperature=temperature, max_new_tokens=9, seed=5, return_routes=True)
    out = engine.generate(prompts, params)
    rows = states = 0
    for t in range(params.max_new_tokens - 1):  # after token t a sample with more tokens feeds it
        fed = [(u, tuple(s.output_ids[:t + 1])) for u, group in enumerate(out) for s in group
               if len(s.output_ids) > t + 1]
        rows, states = rows + len(fed), states + len(set(fed))
    assert engine.states_decoded == states
    assert 0 < states < rows  # some sharing, some splitting
    for prompt, group in zip(prompts, out):
        for s in group:
            logits, routes = hf_forward(hf, prompt + s.output_ids, True)
            ref = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1:-1]
            ref = ref.gather(1, torch.tensor(s.output_ids)[:, None])[:, 0]
            assert np.allclose(s.logprobs, ref.numpy(), atol=1e-4)
            assert np.array_equal(s.routes, routes[:-1].numpy())
