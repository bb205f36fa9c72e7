"""Small measurements and verdicts the GPU kit's sections share: transformers' reference log-probs, an RL batch
as the trainer builds it, weight snapshots, CUDA memory, and a result's checks turned into its status.
"""

from __future__ import annotations

import math
from pathlib import Path


def max_abs_diff(a: list, b: list) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


def transformers_logprobs(model_dir: Path, sequences: list[list[int]], device: str, dtype) -> list:
    """log p(seq[t] | seq[:t]) from transformers' own forward in `dtype` on `device` (fp32 log-softmax), on CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq], device=device)
            logits = model(input_ids=ids).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].cpu())
    del model
    return out


def rl_batch(learner, vocab: int, *, groups: int, group_size: int, length: int, seed: int) -> list[dict]:
    """An RL batch as the trainer builds it: prompts x samples of random tokens, GRPO advantages of random
    rewards, π_old and rollout log-probs from the learner itself (on-policy)."""
    import torch

    from megapo.algorithms import compute_advantages

    gen = torch.Generator().manual_seed(seed)
    prompt_len = max(1, length // 4)
    sequences = []
    for _ in range(groups):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        for _ in range(group_size):
            sequences.append(prompt + torch.randint(0, vocab, (length - prompt_len,), generator=gen).tolist())
    rewards = torch.randint(0, 2, (groups, group_size), generator=gen).float()
    rewards[:, 0], rewards[:, -1] = 0.0, 1.0  # every group mixed: non-zero advantages
    advantages = compute_advantages("grpo", rewards).reshape(-1).tolist()
    old = learner.logprobs(sequences)
    return [dict(tokens=s, prompt_len=prompt_len, advantage=a, old_logp=o[prompt_len - 1:].tolist(),
                 rollout_logp=o[prompt_len - 1:].tolist()) for s, a, o in zip(sequences, advantages, old)]


def snapshot(learner) -> dict:
    return {name: t.detach().to("cpu", copy=True) for name, t in learner.hf_state_dict()}


def finite_metrics(metrics: dict) -> bool:
    return all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))


def cuda_memory() -> dict:
    import torch

    gib = 2 ** 30
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / gib,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / gib,
            "device_total_gib": torch.cuda.get_device_properties(0).total_memory / gib}


def with_checks(result: dict, checks: dict[str, bool]) -> dict:
    result["checks"] = {k: bool(v) for k, v in checks.items()}
    failed = [k for k, v in checks.items() if not v]
    result["status"] = "failed: " + ", ".join(failed) if failed else "ok"
    return result


def first_line(exc: BaseException, limit: int = 400) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__
