#!/usr/bin/env python
"""On-policy preference pairs: the SFT policy's own samples (8 per prompt, temperature 1, the embedded engine) on
the addition task, a correct one against a wrong one of the same prompt (exact match decides), up to two pairs per
prompt, as token ids the way the trainer sees them (rm-train takes token-id pairs as they are).

    onpolicy_pairs.py SFT_DIR OUT.jsonl N_PROMPTS SEED [SPLIT]
"""
import json, random, sys
from megapo.engines.embedded import EmbeddedEngine
from megapo.engines.base import SamplingParams
from megapo.tasks import addition
from megapo.trainer.data import encode_prompt
from megapo.trainer.rewards import exact_match
from transformers import AutoTokenizer

sft, out, n_prompts, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
tok = AutoTokenizer.from_pretrained(sft)
engine = EmbeddedEngine(sft, seed=seed)
eos = tok.convert_tokens_to_ids("<|im_end|>")
rng = random.Random(seed)
rows, n_pairs, n_mixed = [], 0, 0
exs = addition.examples(sys.argv[5] if len(sys.argv) > 5 else "train", n_prompts, seed)
for i in range(0, len(exs), 64):
    batch = exs[i:i + 64]
    prompts = [encode_prompt(tok, ex.prompt, False) for ex in batch]
    groups = engine.generate(prompts, SamplingParams(n=8, max_new_tokens=8, stop_token_ids=(eos,), seed=seed + i))
    for ex, p, g in zip(batch, prompts, groups):
        right = [s.output_ids for s in g if exact_match(tok.decode(s.output_ids, skip_special_tokens=True), ex.answer)]
        wrong = [s.output_ids for s in g if s.output_ids not in right]
        if right and wrong:
            n_mixed += 1
            for w in wrong[:2]:
                rows.append({"prompt": p, "chosen": rng.choice(right), "rejected": w})
with open(out, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
print(f"{len(rows)} pairs from {n_mixed} of {len(exs)} prompts with both a right and a wrong sample")
