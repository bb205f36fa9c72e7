"""The log-probability reward (data.likelihood_reward): the policy's log-probability of the task's reference answer
after its own chain of thought, from "Likelihood-Based Reward Designs for General LLM Reasoning" (Kwiatkowski, Butt,
Labiad, Kempe, Ollivier, 2026), which finds the log-probability of the reference answer the one likelihood reward
that works with and without a verifier (probability rewards such as VeriFree's vanish on long answers):

    L_i = Σ_{t=1..|a*|} log π(a*_t | x, z_i, a*_<t)          mode sum: log π(a* | x, z_i), the paper's reward
    L_i = (1/|a*|) Σ_t log π(a*_t | x, z_i, a*_<t)           mode mean: per answer token (its average variant)
    r_i <- verifier_coef · r_i + coef · L_i                   before the advantages

x the prompt's token ids, z_i sample i's response cut at its answer (cut_response), a* the reference answer's tokens
(Example.answer through the tokenizer, alone, no special tokens), r_i the reward the advantages would otherwise read
(the verifier's, after length shaping and a reward model's term). π is the learner's weights before this step's
update (π_old in a sync run) and L_i enters as a number: its own gradient (a supervised term on a*) is not taken.

The cut (data.likelihood_reward.answer_marker, absent): z_i ends with the token that completes the LAST occurrence
of the marker in the decoded response (the answer the verifier reads follows the last marker, as addition_cot's
";"); that token is kept whole, so text it holds past the marker stays in z_i (a token boundary is the finest
cut). A response without the marker (or an empty marker): `end`, z_i is the whole response less its end-of-sequence
token (finish reason stop), then the marker's tokens, so a* follows the marker either way; `start`, z_i is empty
(a response without the marker is all answer, addition_cot's rule; L_i then does not depend on the response).

The forward: one learner.logprobs call on every sample's x ⊕ z_i ⊕ a*, collective (every rank builds the same
sequences from the same groups), routing freely and dropping its routes (self_teacher.freely_routed_logprobs: no
engine routed these sequences), in update_policy before the advantages. Metrics: reward/likelihood (the batch mean of
L_i), reward/with_likelihood (the mean of the rewards the advantages read), reward/likelihood_marker_frac (the
share of responses holding the marker; with a marker only).
"""

from __future__ import annotations

import torch

MODES = ("sum", "mean")
ABSENT = ("end", "start")


def cut_response(output_ids: list[int], texts: list[str], marker: str, marker_ids: list[int], finished: bool,
                 absent: str) -> tuple[list[int], bool]:
    """(z, found): the response's chain of thought before the reference answer, and whether it holds the marker.
    z = output_ids up to the token completing the marker's last occurrence; without one, per `absent`: end,
    output_ids less the end-of-sequence token (`finished`: finish reason stop) then `marker_ids`; start, []."""
    if absent not in ABSENT:
        raise ValueError(f"absent: must be one of {', '.join(ABSENT)}, got {absent!r}")
    from megapo.algorithms.process_rewards import occurrence_ends

    ends = occurrence_ends(texts, marker)
    if ends:
        return list(output_ids[:ends[-1] + 1]), True
    if absent == "start":
        return [], False
    body = list(output_ids[:-1] if finished and output_ids else output_ids)
    return body + list(marker_ids), False


def answer_logprob(logp: torch.Tensor, answer_len: int, mode: str) -> float:
    """L from a sequence's log-probs (`logp`[j] = log π(token j+1 | tokens ≤ j)) whose last `answer_len` tokens are
    the answer: their sum (mode sum) or mean (mode mean)."""
    if mode not in MODES:
        raise ValueError(f"mode: must be one of {', '.join(MODES)}, got {mode!r}")
    if answer_len < 1 or answer_len > len(logp):
        raise ValueError(f"answer_len: must be in [1, {len(logp)}], got {answer_len}")
    tail = torch.as_tensor(logp, dtype=torch.float64)[-answer_len:]
    return float(tail.sum() if mode == "sum" else tail.mean())


def combined_reward(reward: float, likelihood: float, coef: float, verifier_coef: float) -> float:
    """verifier_coef · r + coef · L."""
    return verifier_coef * reward + coef * likelihood


def encode_text(tokenizer, text: str) -> list[int]:
    """The tokenizer's ids of `text` alone, no special tokens."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def likelihood_sequences(groups: list, spec, tokenizer) -> tuple[list[list[int]], list[int], list[int], list[bool]]:
    """Every sample's x ⊕ z ⊕ a* in batch order, with the prompts' lengths, the answers' token counts and whether
    each response held the marker. `spec`: data.likelihood_reward."""
    from megapo.algorithms.process_rewards import token_texts

    marker_ids = encode_text(tokenizer, spec.answer_marker) if spec.answer_marker else []
    cache: dict = {}  # each token id decoded once per step
    sequences, prompt_lens, answer_lens, found = [], [], [], []
    for g in groups:
        answer = encode_text(tokenizer, str(g.example.answer))
        if not answer:
            raise ValueError(f"data.likelihood_reward: the reference answer {g.example.answer!r} of the prompt "
                             f"{g.example.prompt!r} encodes to no tokens; the reward is its log-probability")
        for s in g.samples:
            out = list(s.output_ids)
            texts = token_texts(tokenizer, out, cache) if spec.answer_marker else [""] * len(out)
            z, hit = cut_response(out, texts, spec.answer_marker, marker_ids, s.finish_reason == "stop", spec.absent)
            sequences.append(list(s.prompt_ids) + z + answer)
            prompt_lens.append(len(s.prompt_ids))
            answer_lens.append(len(answer))
            found.append(hit)
    return sequences, prompt_lens, answer_lens, found


def add_likelihood_rewards(learner, groups: list, spec, tokenizer) -> dict:
    """g.rewards[i] <- verifier_coef · r_i + coef · L_i for every sample of every group, in place, on every rank
    (one collective learner forward); g.scores keeps the rewards before (the verdicts stay the verifier's).
    Returns the metrics reward/likelihood, reward/with_likelihood and, with a marker, reward/likelihood_marker_frac."""
    from megapo.trainer.self_teacher import freely_routed_logprobs

    sequences, prompt_lens, answer_lens, found = likelihood_sequences(groups, spec, tokenizer)
    if not sequences:
        return {}
    logps = freely_routed_logprobs(learner, sequences, prompt_lens)
    likelihood = iter([answer_logprob(lp, n, spec.mode) for lp, n in zip(logps, answer_lens)])
    values: list[float] = []
    for g in groups:
        if g.scores is None:
            g.scores = list(g.rewards)
        extra = [next(likelihood) for _ in g.samples]
        values.extend(extra)
        g.rewards = [combined_reward(r, x, spec.coef, spec.verifier_coef) for r, x in zip(g.rewards, extra)]
    combined = [r for g in groups for r in g.rewards]
    metrics = {"reward/likelihood": sum(values) / len(values), "reward/with_likelihood": sum(combined) / len(combined)}
    if spec.answer_marker:
        metrics["reward/likelihood_marker_frac"] = sum(found) / len(found)
    return metrics
