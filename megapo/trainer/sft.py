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
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

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


def build_examples(tokenizer, task, n: int, seed: int, chat_template: bool = False):
    """Token tensors for `n` training problems of `task` (a name or a megapo.tasks.base.Task): inputs and
    labels (-100 on the prompt), the target being the task's demonstration."""
    from megapo.tasks.registry import get_task
    from megapo.trainer.data import encode_answer, encode_prompt

    pairs = get_task(task).sft_pairs(n, seed)
    rows = [(encode_prompt(tokenizer, ex.prompt, chat_template), encode_answer(tokenizer, target)) for ex, target in pairs]
    width = max(len(p) + len(a) for p, a in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    inputs = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (p, a) in enumerate(rows):
        seq = p + a
        inputs[i, :len(seq)] = torch.tensor(seq)
        labels[i, len(p):len(seq)] = torch.tensor(a)
    return inputs, labels


def train_sft(model_dir: str | Path, out_dir: str | Path, cfg: SFTConfig, task="addition",
              chat_template: bool = False, max_new_tokens: int = 8) -> SFTResult:
    """Train `model_dir` on `task` (a name or a megapo.tasks.base.Task) until validation accuracy (the task's
    reward, greedy) >= cfg.threshold; save to `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megapo.tasks.registry import get_task
    from megapo.trainer.data import encode_prompt
    from megapo.trainer.eval import hf_greedy, score, task_verifier

    task = get_task(task)
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    inputs, labels = build_examples(tokenizer, task, cfg.examples, cfg.seed, chat_template)
    val = task.examples("validation")
    verify = task_verifier(task)
    val_prompts = [encode_prompt(tokenizer, ex.prompt, chat_template) for ex in val]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    batches = _batches(inputs, labels, min(cfg.batch_size, len(inputs)), np.random.default_rng(cfg.seed))
    history: list[dict] = []
    t0 = time.perf_counter()
    acc, step, reached = 0.0, 0, False
    for step in range(1, cfg.max_steps + 1):
        model.train()
        x, y = next(batches)
        loss = model(input_ids=x, labels=y).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % cfg.check_every == 0 or step == cfg.max_steps:
            acc = score(hf_greedy(model, tokenizer, max_new_tokens), tokenizer, val, val_prompts, verify).accuracy
            history.append({"step": step, "loss": loss.item(), "val_accuracy": acc,
                            "seconds": round(time.perf_counter() - t0, 2)})
            log.info("sft step %d loss %.4f val exact-match %.3f", step, loss.item(), acc)
            if acc >= cfg.threshold:
                reached = True
                break
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    result = SFTResult(step, acc, reached, time.perf_counter() - t0, history)
    (out / "sft_result.json").write_text(json.dumps(asdict(result), indent=1))
    return result

