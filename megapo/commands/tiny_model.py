"""`megapo tiny-model --out DIR [--family F --head lm|score ...]`: write a tiny random-weight HF model with its own
tokenizer (megapo/models/tiny.py); --head score writes a one-label *ForSequenceClassification (a reward model)."""

from __future__ import annotations

import argparse
import json

from megapo.models.tiny import HEADS, tiny_families, write_tiny_model

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output folder (HF layout)")
    parser.add_argument("--family", default="qwen3_moe", choices=tiny_families())
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32, help="32/64/... (vLLM on CPU needs one of 32, 64, 80, ...)")
    parser.add_argument("--ffn", type=int, default=128, help="dense MLP width")
    parser.add_argument("--moe-ffn", type=int, default=128, help="expert MLP width")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--head", default="lm", choices=HEADS,
                        help="lm: causal LM; score: *ForSequenceClassification with one label (a reward model)")


def run(args: argparse.Namespace) -> int:
    out = write_tiny_model(
        args.out, args.family, layers=args.layers, experts=args.experts, topk=args.topk, hidden=args.hidden,
        heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, ffn=args.ffn, moe_ffn=args.moe_ffn,
        vocab=args.vocab, seed=args.seed, head=args.head)
    cfg = json.loads((out / "config.json").read_text())
    params = sum(1 for _ in out.glob("*.safetensors"))
    kind = "" if args.head == "lm" else " score"
    print(f"wrote {args.family}{kind} model to {out} ({cfg['num_hidden_layers']} layers, vocab {cfg['vocab_size']}, "
          f"{params} safetensors file(s))")
    return 0
