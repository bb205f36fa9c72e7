"""`--verify`: the converted model must compute what the source computes, not only hold the same tensors.

Tensors can round-trip exactly while the model is still wrong (e.g. a router that normalises its
top-k weights differently, a config field that changes the forward pass), so the check runs both
models on a few sequences: Hugging Face transformers in fp32 on the HF folder, and the Megatron
learner's forward on the checkpoint (worker.learner_logprobs), and compares per-token log-probs and
per-position entropies (the entropy depends on the whole next-token distribution).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_TOL = 1e-4
LENGTHS = (9, 17, 33, 64)  # mixed lengths: packing and several rows of positions


def sequences(vocab_size: int, seed: int = 0, lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    """Fixed pseudo-random token sequences (uniform ids reach every expert and embedding row)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def hf_logprobs(hf_dir: str | Path, seqs: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """transformers fp32: log p(seq[t] | seq[:t]) for t >= 1 and the entropy at each of those positions."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.eval()
    logps, ents = [], []
    with torch.no_grad():
        for seq in seqs:
            ids = torch.tensor([seq])
            logits = model(input_ids=ids).logits[0, :-1].float()
            logsm = torch.log_softmax(logits, dim=-1)
            logps.append(logsm.gather(-1, ids[0, 1:, None])[:, 0])
            ents.append(-(logsm.exp() * logsm).sum(-1))
    return logps, ents


@dataclass
class VerifyResult:
    max_logprob_diff: float
    max_entropy_diff: float
    tol: float

    @property
    def ok(self) -> bool:
        return self.max_logprob_diff <= self.tol and self.max_entropy_diff <= self.tol

    def summary(self) -> str:
        verdict = "OK" if self.ok else "FAILED"
        return (f"verify {verdict}: max |Δ log-prob| = {self.max_logprob_diff:.3g}, "
                f"max |Δ entropy| = {self.max_entropy_diff:.3g} (tolerance {self.tol:g})")


def compare(hf_dir: str | Path, megatron_file: str | Path, seqs: list[list[int]], tol: float) -> VerifyResult:
    """HF forward on hf_dir vs the learner's results saved by the worker in megatron_file."""
    megatron = torch.load(megatron_file, weights_only=True)  # tensors only: no pickled objects run
    ref_logp, ref_ent = hf_logprobs(hf_dir, seqs)
    dlogp = max(float((a - b).abs().max()) for a, b in zip(ref_logp, megatron["logprobs"], strict=True))
    dent = max(float((a - b).abs().max()) for a, b in zip(ref_ent, megatron["entropy"], strict=True))
    return VerifyResult(dlogp, dent, tol)
