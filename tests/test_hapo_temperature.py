"""HAPO's entropy-adaptive sampling temperature (Liu et al. 2025, From Uniform to Heterogeneous: Tailoring Policy
Optimization to Every Token's Nature, arXiv:2509.16591; its authors' vLLM sampler): rollout.adaptive_temperature τ.

References written out here, never the code under test: each token's entropy, standardised log-entropy and
temperature T·(1 + τ·ĥ) as loops over the vocabulary; the embedded engine's draw by inverse CDF at that
temperature and its reported log-prob log_softmax(z / T_row); the batch statistics (the median of log H by nearest
rank, the RMS around it, the extreme z) as loops; the chain metrics -> next rollout's SamplingParams -> checkpoint in
a real `megapo train`; the refusals by field (range, engines that sample at one temperature, async mode)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_runs import train_rows  # noqa: E402

from megapo.config import ConfigError, load_config  # noqa: E402
from megapo.engines.base import EntropyTemperature, SamplingParams  # noqa: E402
from megapo.engines.embedded import EmbeddedEngine  # noqa: E402


def ref_temperature(row: list[float], base: float, t: EntropyTemperature) -> float:
    top = max(row)
    den = sum(math.exp(x - top) for x in row)
    p = [math.exp(x - top) / den for x in row]
    entropy = -sum(q * math.log(q) for q in p if q > 0)
    z = (math.log(max(entropy, 1e-6)) - t.centre) / (t.scale + 1e-6)
    h_hat = min(1.0, max(-1.0, z / t.top if z > 0 else z / -t.bottom))
    return base * (1 + t.tau * h_hat)


def test_engine_draws_each_token_at_its_entropy_temperature_and_reports_that_log_prob():
    gen = torch.Generator().manual_seed(0)
    # rows from peaked (low entropy) to flat (high entropy)
    logits = torch.randn(6, 11, generator=gen) * torch.tensor([8.0, 4.0, 2.0, 1.0, 0.5, 0.1])[:, None]
    uniform = torch.rand(6, generator=gen)
    t = EntropyTemperature(tau=0.4, centre=math.log(1.2), scale=0.7, top=2.0, bottom=-3.0)
    params = SamplingParams(temperature=0.9, entropy_temperature=t)
    me = SimpleNamespace(logprob_mode="scaled")
    token, logp = EmbeddedEngine._sample(me, logits, params, uniform, torch.arange(6))  # each row its own state
    temps = [ref_temperature(r, 0.9, t) for r in logits.double().tolist()]
    assert min(temps) < 0.9 < max(temps)  # both sides of the centre are exercised
    for i, (row, temp) in enumerate(zip(logits.double().tolist(), temps)):
        top = max(x / temp for x in row)
        den = sum(math.exp(x / temp - top) for x in row)
        probs = [math.exp(x / temp - top) / den for x in row]
        cdf, pick = 0.0, len(row) - 1
        for v, q in enumerate(probs):  # inverse CDF with the row's uniform
            cdf += q
            if uniform[i].item() * 1.0 < cdf:
                pick = v
                break
        assert int(token[i]) == pick
        assert float(logp[i]) == pytest.approx(math.log(probs[pick]), abs=2e-5)


def test_without_statistics_the_engine_samples_as_before():
    gen = torch.Generator().manual_seed(1)
    logits, uniform = torch.randn(4, 9, generator=gen), torch.rand(4, generator=gen)
    me = SimpleNamespace(logprob_mode="scaled")
    a = EmbeddedEngine._sample(me, logits, SamplingParams(temperature=0.7), uniform, torch.arange(4))
    zero = EntropyTemperature(tau=0.0, centre=0.0, scale=1.0, top=1.0, bottom=-1.0)  # τ 0: the plain temperature
    b = EmbeddedEngine._sample(me, logits, SamplingParams(temperature=0.7, entropy_temperature=zero), uniform,
                               torch.arange(4))
    assert torch.equal(a[0], b[0]) and torch.allclose(a[1], b[1], rtol=0, atol=1e-7)


def test_batch_statistics_match_the_formula_written_out():
    from megapo.trainer.update import temperature_stats

    gen = torch.Generator().manual_seed(2)
    entropies = [(torch.rand(n, generator=gen, dtype=torch.float64) * 2).tolist() for n in (5, 3, 6, 4)]
    entropies[1][0] = 0.0  # clamped at 1e-6 before the log
    masks = [[1, 1, 0, 1, 1], None, [1] * 6, [0, 1, 1, 1]]
    batch = [dict(tokens=[1] * (len(e) + 1), prompt_len=1, advantage=0.0, old_entropy=e,
                  loss_mask=m if m is not None else [1] * len(e)) for e, m in zip(entropies, masks)]
    got = temperature_stats(batch)
    values = sorted(math.log(max(x, 1e-6)) for e, m in zip(entropies, masks) for x, k in zip(e, m or [1] * len(e))
                    if k)
    centre = values[round(0.5 * (len(values) - 1))]
    scale = math.sqrt(sum((v - centre) ** 2 for v in values) / len(values))
    assert got["hapo_temperature/centre"] == pytest.approx(centre, abs=1e-12)
    assert got["hapo_temperature/scale"] == pytest.approx(scale, abs=1e-12)
    assert got["hapo_temperature/top"] == pytest.approx((values[-1] - centre) / scale, abs=1e-12)
    assert got["hapo_temperature/bottom"] == pytest.approx((values[0] - centre) / scale, abs=1e-12)
    with pytest.raises(ValueError, match="^old_entropy:"):
        temperature_stats([dict(tokens=[1, 2], prompt_len=1, advantage=0.0)])


def test_train_carries_the_statistics_to_the_next_rollout_and_the_checkpoint(tmp_path, tiny_moe):
    """`megapo train` with τ = 0.05: every step logs the batch's statistics, the trainer builds the next rollout's
    EntropyTemperature from them, and the checkpoint after step 2 keeps step 2's."""
    from megapo.trainer.run import Run

    rows = train_rows(tmp_path, "hapo_t", f"model.path={tiny_moe}", "train.steps=2", "data.prompts_per_step=4",
                      "rollout.n_samples=4", "rollout.adaptive_temperature=0.05", "train.ckpt_every=2")
    assert len(rows) == 2
    for r in rows:
        assert r["hapo_temperature/scale"] > 0 and r["hapo_temperature/top"] > 0 > r["hapo_temperature/bottom"]
    saved = json.loads(next((tmp_path / "hapo_t").rglob("trainer_state.json")).read_text())
    want = {k: rows[-1][f"hapo_temperature/{k}"] for k in ("centre", "scale", "top", "bottom")}
    assert saved["extra"]["entropy_temperature"] == pytest.approx(want, abs=1e-9)
    me = SimpleNamespace(cfg=SimpleNamespace(rollout=SimpleNamespace(adaptive_temperature=0.05)),
                         params=SamplingParams(temperature=1.0))
    Run._set_temperature(me, saved["extra"]["entropy_temperature"])  # what a resume does with it
    assert me.params.entropy_temperature == EntropyTemperature(tau=0.05, **saved["extra"]["entropy_temperature"])


def _config(model, tmp_path, *overrides):
    from megapo.trainer.config import RunConfig

    items = [f"model.path={model}", "rollout.n_samples=4", "rollout.max_new_tokens=8", "data.task=addition",
             "data.max_prompt_tokens=16", "data.prompts_per_step=8", "train.steps=3",
             f"train.output_dir={tmp_path / 'run'}", *overrides]
    return load_config(RunConfig, None, items)


def test_config_refuses_values_engines_and_async_runs(tiny_moe, tmp_path):
    assert _config(tiny_moe, tmp_path, "rollout.adaptive_temperature=0.05").rollout.adaptive_temperature == 0.05
    for value in ("1.0", "-0.01"):
        with pytest.raises(ConfigError) as err:
            _config(tiny_moe, tmp_path, f"rollout.adaptive_temperature={value}")
        assert err.value.field == "rollout.adaptive_temperature"
    with pytest.raises(ConfigError) as err:
        _config(tiny_moe, tmp_path, "rollout.engine=vllm", "rollout.weight_sync=disk", "algorithm.routing_replay=off",
                "rollout.adaptive_temperature=0.05")
    assert err.value.field == "rollout.adaptive_temperature" and "'vllm'" in str(err.value)
    with pytest.raises(ConfigError) as err:
        _config(tiny_moe, tmp_path, "train.mode=async", "rollout.adaptive_temperature=0.05")
    assert err.value.field == "rollout.adaptive_temperature" and "sync" in str(err.value)


def test_servers_refuse_per_token_temperatures_and_bad_statistics_are_refused():
    from megapo.engines.vllm import vllm_sampling_params

    t = EntropyTemperature(tau=0.05, centre=0.0, scale=1.0, top=1.0, bottom=-1.0)
    with pytest.raises(ValueError, match="^entropy_temperature:"):
        vllm_sampling_params(SamplingParams(entropy_temperature=t), None)
    with pytest.raises(ValueError, match="top > 0 > bottom"):
        EntropyTemperature(tau=0.05, centre=0.0, scale=1.0, top=1.0, bottom=0.5)
    with pytest.raises(ValueError, match="EntropyTemperature.centre"):
        EntropyTemperature(tau=0.05, centre=float("nan"), scale=1.0, top=1.0, bottom=-1.0)
