"""The learner's backward is the same from one run to the next on CPU: its embedding layer's weight gradient, the one
op found to add in a thread-dependent order (Megatron's deterministic_mode looked rows up with weight[ids], whose
backward races on CPU), repeated with two threads from the same inputs, gives one result."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import hashlib, sys, torch
from megapo.layout import read_hf_config
from megapo.models.family import family_for
from megapo.learner.backend import Backend
from megapo.learner.model import init_distributed, transformer_config
from megapo.config import ParallelConfig
from megatron.core.tensor_parallel import VocabParallelEmbedding

torch.set_num_threads(2)
hf = read_hf_config(sys.argv[1])
spec = family_for(hf).spec(hf)
parallel, backend = ParallelConfig(), Backend("cpu", "gloo", False)
init_distributed(parallel, backend, seed=0, spec=spec)
config = transformer_config(spec, parallel, backend)
emb = VocabParallelEmbedding(spec.vocab_size, config.hidden_size, init_method=config.init_method, config=config)
gen = torch.Generator().manual_seed(0)
ids = torch.randint(0, spec.vocab_size, (64, 56), generator=gen)  # a main-job micro-batch's shape, rows repeat ids
upstream = torch.randn(64, 56, config.hidden_size, generator=gen)
hashes = set()
for _ in range(40):
    emb.weight.grad = None
    (emb(ids) * upstream).sum().backward()
    hashes.add(hashlib.sha256(emb.weight.grad.numpy().tobytes()).hexdigest())
print(len(hashes))
torch.distributed.destroy_process_group()
'''


def test_the_embedding_backward_adds_in_one_order_with_two_threads(tiny_moe):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_moe)], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "1", out.stdout  # distinct weight gradients over 40 backwards
