"""Supervised warm start of an HF model on a task's demonstrations, straight in PyTorch (the
command: megapo/commands/sft.py).

RL needs a policy that sometimes gets the answer right. A fixed set of examples (2000 by default)
is trained with AdamW until greedy exact-match on the validation split reaches a threshold
(0.2 by default, checked every 20 steps), then the HF folder (weights + tokenizer) is written.
Stopping early matters: unlimited SFT solves the task outright and leaves RL nothing to do.
The loss covers the response tokens (the task's demonstration: the answer, or e.g. a scratchpad then
the answer) and end-of-sequence only, not the prompt. Validation accuracy uses the task's own reward.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from megapo.progress import Progress
from megapo.trainer.config import SFTConfig

log = logging.getLogger(__name__)


@dataclass
class SFTResult:
    steps: int
    val_accuracy: float
    reached: bool
    seconds: float
    history: list[dict]


def _batches(inputs: torch.Tensor, labels: torch.Tensor, batch_size: int, rng: np.random.Generator):
    while True:
        order = torch.from_numpy(rng.permutation(len(inputs)))
        for start in range(0, len(inputs) - batch_size + 1, batch_size):  # full batches; the order changes per epoch
            idx = order[start:start + batch_size]
            yield inputs[idx], labels[idx]


def build_examples(tokenizer, task, n: int, seed: int, chat_template: bool = False, turns=None):
    """Token tensors for `n` training problems of `task` (a name or a megapo.tasks.base.Task): inputs and
    labels (-100 on the prompt), the target being the task's demonstration. With `turns` (envs.rollout.TurnPlay)
    a demonstration is a list of policy turns, each ending with end-of-sequence, and the environment's
    observations between them are context (-100), tokenised as the rollouts tokenise them."""
    from megapo.tasks.registry import get_task
    from megapo.trainer.data import encode_answer, encode_prompt

    pairs = get_task(task).sft_pairs(n, seed)
    rows = []  # (token ids, trained flags)
    for i, (ex, target) in enumerate(pairs):
        prompt = encode_prompt(tokenizer, ex.prompt, chat_template)
        if turns is None:
            answer = encode_answer(tokenizer, target)
            rows.append((prompt + answer, [False] * len(prompt) + [True] * len(answer)))
        else:
            rows.append(_played(tokenizer, ex, target, prompt, turns, chat_template, i))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    inputs = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (ids, trained) in enumerate(rows):
        seq = torch.tensor(ids)
        inputs[i, :len(ids)] = seq
        labels[i, :len(ids)] = torch.where(torch.tensor(trained), seq, torch.full_like(seq, -100))
    return inputs, labels


def _played(tokenizer, example, policy_turns, prompt: list[int], turns, chat_template: bool, i: int):
    """One multi-turn demonstration: the policy turns with the environment's answers between them."""
    from megapo.envs.rollout import ObservationFormat
    from megapo.trainer.data import encode_answer

    if isinstance(policy_turns, str) or not policy_turns:
        raise ValueError(f"demonstration {i}: a multi-turn task's demonstration is a non-empty list of policy turns")
    observe = ObservationFormat(tokenizer, chat_template)
    env = turns.make_env(example)
    env.reset(example)
    ids, trained = list(prompt), [False] * len(prompt)
    for k, text in enumerate(policy_turns):
        turn = encode_answer(tokenizer, text)
        ids += turn
        trained += [True] * len(turn)
        result = env.step(text)
        if result.done != (k == len(policy_turns) - 1):
            raise ValueError(f"demonstration {i}: the environment {'ended' if result.done else 'did not end'} the "
                             f"trajectory after turn {k + 1} of {len(policy_turns)} ({text!r})")
        if not result.done:
            obs = observe.encode(result.observation)
            ids += obs
            trained += [False] * len(obs)
    return ids, trained


def train_sft(model_dir: str | Path, out_dir: str | Path, cfg: SFTConfig, task="addition",
              chat_template: bool = False, max_new_tokens: int = 8, turns=None) -> SFTResult:
    """Train `model_dir` on `task` (a name or a megapo.tasks.base.Task) until validation accuracy (the task's
    reward, greedy) >= cfg.threshold; save to `out_dir`. `turns` (envs.rollout.TurnPlay): a multi-turn task,
    its demonstrations played with the environment and validated multi-turn (`max_new_tokens` per turn)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megapo.tasks.registry import get_task
    from megapo.trainer.data import encode_prompt
    from megapo.trainer.eval import engine_from_hf, hf_greedy, score, score_trajectories, task_verifier

    task = get_task(task)
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    inputs, labels = build_examples(tokenizer, task, cfg.examples, cfg.seed, chat_template, turns)
    val = task.examples("validation")
    verify = task_verifier(task)
    val_prompts = [encode_prompt(tokenizer, ex.prompt, chat_template) for ex in val]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    batches = _batches(inputs, labels, min(cfg.batch_size, len(inputs)), np.random.default_rng(cfg.seed))
    history: list[dict] = []
    t0 = time.perf_counter()
    acc, step, reached = 0.0, 0, False
    bar = Progress(cfg.max_steps, "sft (to max_steps)", stream=sys.stderr)  # a bar on a terminal, else nothing
    for step in range(1, cfg.max_steps + 1):
        bar.update(step - 1)
        model.train()
        x, y = next(batches)
        loss = model(input_ids=x, labels=y).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % cfg.check_every == 0 or step == cfg.max_steps:
            if turns is None:
                acc = score(hf_greedy(model, tokenizer, max_new_tokens), tokenizer, val, val_prompts, verify).accuracy
            else:
                acc = score_trajectories(engine_from_hf(model), tokenizer, val, val_prompts, verify, turns,
                                         chat_template, max_new_tokens).accuracy
            history.append({"step": step, "loss": loss.item(), "val_accuracy": acc,
                            "seconds": round(time.perf_counter() - t0, 2)})
            bar.clear()
            log.info("sft step %d loss %.4f val exact-match %.3f", step, loss.item(), acc)
            if acc >= cfg.threshold:
                reached = True
                break
    bar.clear()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    result = SFTResult(step, acc, reached, time.perf_counter() - t0, history)
    (out / "sft_result.json").write_text(json.dumps(asdict(result), indent=1))
    return result

