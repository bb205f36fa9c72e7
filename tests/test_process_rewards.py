"""Dense rewards from a reward model (data.reward_model.dense; megapo/algorithms/process_rewards.py,
megapo/trainer/reward_model.py).

References: step boundaries written out by hand for a byte-level stand-in tokenizer (a delimiter inside a token,
several in one token, none, one at the end, one spanning two tokens, a multi-byte one split over byte tokens);
the process advantage as a float64 loop over the module docstring's formula (r_k, G_t as the double sum, the
group's token mean and population std); the metrics of dense_model_rewards from those loops on stand-in scores;
the tiny tokenizer's cuts of an addition_cot scratchpad at ";". Config refusals name their field. A 2-step
`megapo train` of the main job's config with a tiny reward model and dense=step: reward/process_mean and
reward/steps_per_response against transformers' AutoModelForSequenceClassification on each step's prefix of the
trained samples (samples.jsonl), steps found by decoding every prefix of the response. Per-position scores against
transformers: tests/test_rm_train.py (test_prefix_scores_equal_transformers_on_each_prefix_alone, TP=1 and
TP=2 x DP=2).
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch

from megapo.algorithms.process_rewards import (add_to_advantages, incremental_texts, process_advantages, step_ends,
                                               token_texts)


class ByteTokenizer:
    """Token id -> bytes; decode joins them and decodes UTF-8 (an incomplete character as U+FFFD, as byte-level
    BPE tokenizers do); id 0 is a special token (end of sequence), left out with skip_special_tokens."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = [b"<eos>"] + pieces

    def ids(self, *pieces: bytes) -> list[int]:
        return [self.pieces.index(p) for p in pieces]

    def decode(self, ids, skip_special_tokens=False):
        kept = [i for i in ids if not (skip_special_tokens and i == 0)]
        return b"".join(self.pieces[i] for i in kept).decode("utf-8", errors="replace")


STOP = "\u3002"  # the ideographic full stop: three bytes in UTF-8
TOKENIZER = ByteTokenizer([b"ab", b"c\nd", b"ef", b"\n\nb\n", b"a", b"\n", b"a\n", b"\nb", STOP.encode()[:1],
                           STOP.encode()[1:2], STOP.encode()[2:], b"x"])


@pytest.mark.parametrize("pieces, delimiter, ends", [
    ((b"ab", b"c\nd", b"ef"), "\n", [1, 2]),  # inside a token: the step ends with that token
    ((b"a", b"\n\nb\n", b"ab"), "\n", [1, 2]),  # several in one token: one step ends there
    ((b"ab", b"ef"), "\n", [1]),  # none: the whole response is one step
    ((b"ab", b"\n"), "\n", [1]),  # at the end: the last step, once
    ((b"\n", b"ab"), "\n", [0, 1]),  # first
    ((b"a\n", b"\nb", b"ab"), "\n\n", [1, 2]),  # spanning two tokens: ends with the token completing it
    ((b"a\n", b"ab", b"\nb"), "\n\n", [2]),  # its characters apart: no occurrence
    ((b"x", STOP.encode()[:1], STOP.encode()[1:2], STOP.encode()[2:], b"x"), STOP, [3, 4]),  # split over bytes
    ((b"ab", b"\n", b"<eos>"), "\n", [1, 2]),  # a special token (no text) still ends the last step
])
def test_step_ends_hand_written(pieces, delimiter, ends):
    ids = TOKENIZER.ids(*pieces)
    assert step_ends(token_texts(TOKENIZER, ids), delimiter) == ends
    assert step_ends(incremental_texts(TOKENIZER, ids), delimiter) == ends  # the path context-dependent tokenizers take


def test_step_ends_of_a_scratchpad_with_the_tiny_tokenizer(tiny_moe):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_moe)
    ids = tokenizer.encode("7+5+0=12;4+8+1=13;132")
    semis = [i for i, t in enumerate(ids) if tokenizer.decode([t]) == ";"]
    assert len(semis) == 2
    assert step_ends(token_texts(tokenizer, ids), ";") == [*semis, len(ids) - 1]


def test_token_texts_join_to_the_decoded_response():
    ids = TOKENIZER.ids(b"x", STOP.encode()[:1], STOP.encode()[1:2], STOP.encode()[2:], b"c\nd", b"<eos>")
    texts = token_texts(TOKENIZER, ids)
    assert texts == ["x", "", "", STOP, "c\nd", ""]  # the character belongs to the token completing it
    assert incremental_texts(TOKENIZER, ids) == texts
    assert "".join(texts) == TOKENIZER.decode(ids, skip_special_tokens=True)


class LeadingSpaceTokenizer:
    """SentencePiece-like: "▁" is a space, and the decoded text's first space is dropped, so a token decoded alone
    loses the space it carries in the middle of a response."""

    pieces = ["<eos>", "\u2581a", "b", "\u2581c\n", "\u2581d"]

    def decode(self, ids, skip_special_tokens=False):
        text = "".join(self.pieces[i] for i in ids if i or not skip_special_tokens).replace("\u2581", " ")
        return text[1:] if text.startswith(" ") else text


def test_token_texts_keep_spaces_a_token_alone_would_lose():
    tokenizer = LeadingSpaceTokenizer()
    ids = [1, 2, 3, 4, 0]
    texts = token_texts(tokenizer, ids)
    assert texts == ["a", "b", " c\n", " d", ""] and "".join(texts) == tokenizer.decode(ids, True)
    assert step_ends(texts, "\n") == [2, 4] and step_ends(texts, " ") == [2, 3, 4]


def loop_process_advantages(scores, ends, group_sizes, eps=1e-6):
    """The module docstring's formula, term by term in float64: r_k = s(e_k) − s(e_{k−1}) with s(e_0) the prompt's
    score (scores[i][0]), G_t = Σ_{k: e_k ≥ t} r_k, (G − μ_g)/(σ_g + eps) over the group's tokens."""
    rewards, returns = [], []
    for s, e in zip(scores, ends):
        s = [float(x) for x in s]
        prev = [-1] + e[:-1]
        r = [s[e[k] + 1] - s[prev[k] + 1] for k in range(len(e))]
        rewards.append(r)
        returns.append([sum(r[k] for k in range(len(e)) if e[k] >= t) for t in range(len(s) - 1)])
    out, lo = [], 0
    for n in group_sizes:
        flat = [g for gs in returns[lo:lo + n] for g in gs]
        mean = sum(flat) / len(flat)
        std = (sum((g - mean) ** 2 for g in flat) / len(flat)) ** 0.5
        out.extend([[(g - mean) / (std + eps) for g in gs] for gs in returns[lo:lo + n]])
        lo += n
    return out, rewards


def random_case(seed=0):
    rng = random.Random(seed)
    lengths = [5, 1, 7, 3, 4, 6]
    scores = [torch.tensor([rng.gauss(0, 1) for _ in range(n + 1)], dtype=torch.float32) for n in lengths]
    ends = [sorted(set(rng.sample(range(n - 1), rng.randint(0, max(n - 2, 0))) if n > 1 else []) | {n - 1})
            for n in lengths]
    return scores, ends, [3, 1, 2]  # ragged groups (after a group filter), one of a single sample


def test_process_advantages_match_the_formula_loop():
    scores, ends, sizes = random_case()
    got, rewards = process_advantages(scores, ends, sizes)
    ref, ref_rewards = loop_process_advantages(scores, ends, sizes)
    for g, r in zip(got, ref):
        assert g.dtype == torch.float64 and len(g) == len(r)
        assert max(abs(a - b) for a, b in zip(g.tolist(), r)) < 1e-12
    for g, r in zip(rewards, ref_rewards):
        assert max(abs(a - b) for a, b in zip(g.tolist(), r)) < 1e-12
    assert got[3].abs().max() < 1e-9  # a group of one: its returns are its mean
    # per-token mode (every token a step): the same formula
    token_ends = [list(range(len(s) - 1)) for s in scores]
    got, _ = process_advantages(scores, token_ends, sizes)
    ref, _ = loop_process_advantages(scores, token_ends, sizes)
    assert max(abs(a - b) for g, r in zip(got, ref) for a, b in zip(g.tolist(), r)) < 1e-12


def test_add_to_advantages_repeats_a_sequence_advantage_and_keeps_per_token_ones():
    process = [torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64), torch.tensor([2.0], dtype=torch.float64)]
    out = add_to_advantages([0.25, [3.0]], process, coef=0.5)
    assert out == [[0.75, -0.25, 0.5], [4.0]]
    with pytest.raises(ValueError, match=r"advantages\[1\]"):
        add_to_advantages([0.25, [3.0, 1.0]], process, coef=0.5)


def test_dense_model_rewards_and_process_advantages_on_groups():
    """The trainer's side: prefix scores asked from the prompt's last token on, steps from the tokenizer, metrics
    from the loop above, the groups' rewards untouched, per-token advantages A + coef · Â in the batch."""
    from megapo.trainer.reward_model import add_process_advantages, dense_model_rewards

    class StandInRM:
        def prefix_scores(self, sequences, starts):
            self.asked = (sequences, starts)
            return [torch.tensor([float((7 * sum(s[:p + 1])) % 5) for p in range(a, len(s))]) for s, a in
                    zip(sequences, starts)]

    def sample(p, *pieces):
        return SimpleNamespace(prompt_ids=p, output_ids=TOKENIZER.ids(*pieces))

    groups = [SimpleNamespace(samples=[sample([9, 9], b"ab", b"c\nd", b"ef"), sample([9, 9], b"a\n", b"<eos>")],
                              rewards=[1.0, 0.0]),
              SimpleNamespace(samples=[sample([8], b"\n\nb\n", b"ab", b"\n", b"ef")], rewards=[0.5])]
    rm = StandInRM()
    dense, metrics = dense_model_rewards(rm, groups, "step", "\n", TOKENIZER)
    assert rm.asked[1] == [1, 1, 0]
    assert dense.ends == [[1, 2], [0, 1], [0, 2, 3]] and dense.group_sizes == [2, 1]
    assert [g.rewards for g in groups] == [[1.0, 0.0], [0.5]]
    _, rewards = loop_process_advantages(dense.scores, dense.ends, dense.group_sizes)
    flat = [r for rs in rewards for r in rs]
    assert metrics["reward/process_mean"] == pytest.approx(sum(flat) / len(flat), abs=1e-12)
    assert metrics["reward/steps_per_response"] == pytest.approx(7 / 3)
    assert metrics["reward/model"] == pytest.approx(sum(float(s[-1]) for s in dense.scores) / 3)

    batch = [SimpleNamespace(advantage=a) for a in (0.5, -0.5, 0.0)]
    add_process_advantages(batch, dense, coef=2.0)
    ref, _ = loop_process_advantages(dense.scores, dense.ends, dense.group_sizes)
    for x, a, r in zip(batch, (0.5, -0.5, 0.0), ref):
        assert x.advantage == pytest.approx([a + 2.0 * v for v in r], abs=1e-12)
    tokens, _ = dense_model_rewards(rm, groups, "token", "\n", TOKENIZER)
    assert tokens.ends == [[0, 1, 2], [0, 1], [0, 1, 2, 3]]


# ----------------------------------------------------------------------------- config


def _load(tmp_path, tiny_moe, *overrides):
    from megapo.config import load_config
    from megapo.trainer.config import RunConfig

    return load_config(RunConfig, None, [f"model.path={tiny_moe}", "data.task=addition",
                                         f"train.output_dir={tmp_path / 'run'}", *overrides])


def test_dense_refusals_name_the_field(tmp_path, tiny_moe, tiny_model_factory):
    from megapo.config import ConfigError

    rm = f"data.reward_model.path={tiny_model_factory('qwen3_moe', head='score')}"
    haepo = ("algorithm.objective=haepo", "algorithm.stages=[{name: plackett_luce}]", "algorithm.entropy_coef=0.01")
    cases = [
        (("data.reward_model.dense=steps", rm), "data.reward_model.dense", "off, step, token"),
        (("data.reward_model.dense=on", rm), "data.reward_model.dense", "off, step, token"),
        (("data.reward_model.dense=step", 'data.reward_model.step_delimiter=""', rm),
         "data.reward_model.step_delimiter", "non-empty"),
        (("data.reward_model.dense=token",), "data.reward_model.dense", "data.reward_model.path"),
        (("data.reward_model.dense=step", "data.reward_model.url=http://127.0.0.1:9"), "data.reward_model.dense",
         "one score per sequence"),
        (("data.reward_model.dense=step", rm, *haepo), "data.reward_model.dense", "haepo"),
        (("data.reward_model.dense=step", rm, "data.task=calculator", "env.name=auto", "train.eval_prompts=0"),
         "data.reward_model.dense",
         "multi-turn"),
    ]
    for overrides, field, words in cases:
        with pytest.raises(ConfigError) as err:
            _load(tmp_path, tiny_moe, *overrides)
        assert err.value.field == field, (overrides, str(err.value))
        assert words in str(err.value), (overrides, str(err.value))
    cfg = _load(tmp_path, tiny_moe, "data.reward_model.dense=step", rm)
    assert cfg.data.reward_model.dense_mode() == "step" and cfg.data.reward_model.step_delimiter == "\n"
    assert _load(tmp_path, tiny_moe, "data.reward_model.dense=off").data.reward_model.dense_mode() == "off"


# ----------------------------------------------------------------------------- a run


def naive_step_ends(tokenizer, ids: list[int], delimiter: str) -> list[int]:
    """Where the count of `delimiter` in the decoded prefix response[:t + 1] goes up, and the last token."""
    counts = [tokenizer.decode(ids[:t + 1], skip_special_tokens=True).count(delimiter) for t in range(len(ids))]
    return sorted({t for t in range(len(ids)) if counts[t] > (counts[t - 1] if t else 0)} | {len(ids) - 1})


def transformers_scores(hf, sequences: list[list[int]]) -> list[float]:
    """Each sequence scored by transformers as one batch, right-padded with pad_token_id under an attention mask:
    the model scores each at its last token that is not pad, as it would alone (padding after it is masked out)."""
    pad, width = hf.config.pad_token_id, max(map(len, sequences))
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask).logits[:, 0].tolist()


def test_a_run_with_dense_step_rewards_logs_the_process_rewards(tmp_path, tiny_moe, tiny_model_factory):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from train_runs import train_rows

    rm = tiny_model_factory("qwen3_moe", head="score")
    delimiter = "e"  # frequent in the tiny tokenizer's merges: the random policy's responses hold several steps
    rows = train_rows(tmp_path, "dense", f"model.path={tiny_moe}", "train.steps=2", "data.prompts_per_step=4",
                      f"data.reward_model.path={rm}", "data.reward_model.dense=step",
                      f"data.reward_model.step_delimiter={delimiter}", "train.log_samples=true")
    assert [r["step"] for r in rows] == [1, 2]
    hf = AutoModelForSequenceClassification.from_pretrained(rm, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_moe)
    samples = [json.loads(line) for line in (tmp_path / "dense" / "samples.jsonl").read_text().splitlines()]
    for r in rows:
        mine = [s for s in samples if s["step"] == r["step"]]
        ends = [[-1, *naive_step_ends(tokenizer, s["response_ids"], delimiter)] for s in mine]
        prefixes = [s["prompt_ids"] + s["response_ids"][:e + 1] for s, es in zip(mine, ends) for e in es]
        at = iter(transformers_scores(hf, prefixes))
        scores = [[next(at) for _ in es] for es in ends]
        rewards = [b - a for sc in scores for a, b in zip(sc, sc[1:])]
        assert r["reward/steps_per_response"] == pytest.approx(len(rewards) / len(mine), abs=1e-12)
        assert r["reward/steps_per_response"] > 1.2  # several steps: the cuts are tested, not only the last token
        assert r["reward/process_mean"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-5)
        assert "reward/with_model" not in r  # the RM's score enters the advantages, not the reward
