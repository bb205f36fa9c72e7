"""Held-out accuracy by greedy decoding, from an HF model folder / module or from a rollout engine.

    acc = evaluate("runs/x/sft", task="addition", split="test")            # HF folder
    acc = evaluate(engine, task="addition", split="test", tokenizer=tok)    # any megapo Engine

A response counts when the task's reward (megapo.tasks.registry; addition: exact match) scores its
decoded text (special tokens removed) above 0.5 and the sequence ended with end-of-sequence, not the
length limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from megapo.engines.base import Engine, SamplingParams
from megapo.tasks.base import Example

GenerateFn = Callable[[list[list[int]]], list[tuple[list[int], bool]]]  # prompts -> (output ids, ended with eos)


@dataclass
class EvalResult:
    accuracy: float
    correct: int
    total: int
    mean_response_len: float
    lengths: list[int] = field(default_factory=list)  # response tokens of each example, end-of-sequence included
    solved: list[bool] = field(default_factory=list)  # each example's verdict
    difficulties: list[int | None] = field(default_factory=list)  # each example's task difficulty
    kinds: list[str] = field(default_factory=list)  # each response's kind (Task.response_kind), when the task has one
    extra: dict[str, float] = field(default_factory=dict)  # multi-turn: envs.rollout.trajectory_metrics

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """accuracy, response_len, and by difficulty bucket k: acc_d{k}; lengths as metrics.length_metrics
        (len/mean, len/p90, len/d{k}, len/d{k}_p90)."""
        from megapo.trainer.metrics import length_metrics

        out = {f"{prefix}accuracy": self.accuracy, f"{prefix}response_len": self.mean_response_len}
        for k in sorted({d for d in self.difficulties if d is not None}):
            bucket = [ok for ok, d in zip(self.solved, self.difficulties) if d == k]
            out[f"{prefix}acc_d{k}"] = sum(bucket) / len(bucket)
        out.update({prefix + key: v for key, v in length_metrics(self.lengths, self.difficulties).items()})
        for kind in sorted(set(self.kinds)):
            out[f"{prefix}kind/{kind}"] = self.kinds.count(kind) / len(self.kinds)
        out.update({prefix + key: v for key, v in self.extra.items()})
        return out


@torch.no_grad()
def hf_greedy(model, tokenizer, max_new_tokens: int, batch_size: int = 256) -> GenerateFn:
    """Greedy generation with an HF causal LM (left-padded batches, KV cache)."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos

    def generate(prompts: list[list[int]]) -> list[tuple[list[int], bool]]:
        model.eval()
        out: list[tuple[list[int], bool]] = []
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=eos, pad_token_id=pad)
            for row in gen[:, width:].tolist():
                if eos in row:
                    out.append((row[:row.index(eos)], True))
                else:
                    out.append((row, False))
        return out

    return generate


def greedy_params(eos_token_id: int, max_new_tokens: int) -> SamplingParams:
    """The held-out evaluations' sampling: temperature 0, one sample, stop at end-of-sequence, seed 0."""
    return SamplingParams(n=1, temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens,
                          stop_token_ids=(eos_token_id,), seed=0)


def engine_greedy(engine: Engine, eos_token_id: int, max_new_tokens: int, batch_size: int = 256) -> GenerateFn:
    """Greedy generation through a megapo Engine (temperature 0, one sample, stop at end-of-sequence), `batch_size`
    prompts per call: the embedded engine keeps its KV cache at the largest batch it has seen, and a cache sized
    for a whole test split instead of a training batch slowed every later training step."""
    params = greedy_params(eos_token_id, max_new_tokens)

    def generate(prompts: list[list[int]]) -> list[tuple[list[int], bool]]:
        out = []
        groups = [g for i in range(0, len(prompts), batch_size) for g in engine.generate(prompts[i:i + batch_size], params)]
        for group in groups:
            s = group[0]
            ids = list(s.output_ids)
            ended = bool(ids) and ids[-1] == eos_token_id
            out.append((ids[:-1] if ended else ids, ended))
        return out

    return generate


def score_trajectories(engine: Engine, tokenizer, examples: Sequence[Example], prompt_ids: Sequence[list[int]],
                       verify: Callable[[Example, str], float], turns, chat_template: bool, max_new_tokens: int,
                       batch_size: int = 256) -> EvalResult:
    """Greedy multi-turn accuracy: each example's trajectory with its environment (`turns`: envs.rollout.TurnPlay);
    the verifier reads the last policy turn (or the environment's reward), a trajectory cut short counts wrong;
    lengths count every token after the prompt, observations included."""
    from megapo.envs.rollout import trajectory_metrics, trajectory_sampler

    eos = tokenizer.eos_token_id
    params = greedy_params(eos, max_new_tokens)
    sample = trajectory_sampler(turns.make_env, tokenizer, chat_template, turns.limits)
    trajectories = [g[0] for i in range(0, len(prompt_ids), batch_size)
                    for g in sample(engine, list(prompt_ids[i:i + batch_size]), list(examples[i:i + batch_size]), params)]
    solved = []
    for ex, t in zip(examples, trajectories):
        value = t.env_reward if t.env_reward is not None else verify(
            ex, tokenizer.decode(t.answer_ids((eos,)), skip_special_tokens=True))
        solved.append(t.finish_reason == "stop" and value > 0.5)
    lengths = [len(t.output_ids) for t in trajectories]
    total = len(examples)
    return EvalResult(sum(solved) / max(total, 1), sum(solved), total, sum(lengths) / max(total, 1), lengths, solved,
                      [getattr(ex, "difficulty", None) for ex in examples], extra=trajectory_metrics(trajectories))


def engine_from_hf(model):
    """An embedded engine holding a copy of an HF model's current weights (multi-turn eval of a model)."""
    from megapo.engines.embedded import EmbeddedEngine

    return EmbeddedEngine(config=model.config.to_dict(), named_tensors=list(model.state_dict().items()))


def task_verifier(task) -> Callable[[Example, str], float]:
    """verify(example, response) of a task (a name or a Task): its own reward against the example's answer."""
    from megapo.tasks.registry import get_task
    from megapo.trainer.rewards import get_reward

    fn = get_reward(get_task(task).reward, "data.task")
    return lambda example, response: fn(response, example.answer)


def score(generate: GenerateFn, tokenizer, examples: Sequence[Example], prompt_ids: Sequence[list[int]],
          verify: Callable[[Example, str], float], kind: Callable[[str], str] | None = None) -> EvalResult:
    outputs = generate(list(prompt_ids))
    lengths = [len(ids) + int(ended) for ids, ended in outputs]
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids, _ in outputs]
    solved = [ended and verify(ex, text) > 0.5 for ex, text, (_, ended) in zip(examples, texts, outputs)]
    total = len(examples)
    return EvalResult(sum(solved) / max(total, 1), sum(solved), total, sum(lengths) / max(total, 1), lengths,
                      solved, [getattr(ex, "difficulty", None) for ex in examples],
                      [kind(text) for text in texts] if kind is not None else [])


def evaluate(model_or_engine, task: str = "addition", split: str = "test", *, n: int | None = None,
             tokenizer=None, chat_template: bool = False, max_new_tokens: int = 8, batch_size: int = 256,
             turns=None) -> EvalResult:
    """Greedy accuracy on a task's split (`task`: a name of megapo.tasks.registry or a Task).

    `model_or_engine`: an HF folder path, an HF model (then pass `tokenizer`), or a megapo Engine
    (anything with `.generate(prompts, params)`; pass `tokenizer`). `turns` (envs.rollout.TurnPlay): multi-turn,
    each example played with its environment (score_trajectories; `max_new_tokens` per turn)."""
    from megapo.tasks.registry import get_task
    from megapo.trainer.data import encode_prompt

    task = get_task(task)
    model = model_or_engine
    if isinstance(model, (str, Path)):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = tokenizer or AutoTokenizer.from_pretrained(model)
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    if tokenizer is None:
        raise ValueError("tokenizer is required when model_or_engine is not a folder")
    examples = task.examples(split, n)
    prompts = [encode_prompt(tokenizer, ex.prompt, chat_template) for ex in examples]
    if turns is not None:
        engine = engine_from_hf(model) if isinstance(model, torch.nn.Module) else model
        return score_trajectories(engine, tokenizer, examples, prompts, task_verifier(task), turns, chat_template,
                                  max_new_tokens, batch_size)
    if hasattr(model, "generate") and isinstance(model, torch.nn.Module):
        gen = hf_greedy(model, tokenizer, max_new_tokens, batch_size)
    else:
        gen = engine_greedy(model, tokenizer.eos_token_id, max_new_tokens, batch_size)
    return score(gen, tokenizer, examples, prompts, task_verifier(task), task.response_kind)
