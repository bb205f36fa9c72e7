"""Rollout throughput benchmark (not a test): generated tokens/s, written as JSON.

  python tools/bench/rollout.py --engine embedded [--model DIR] [--out rollout.json]
  python tools/bench/rollout.py --engine vllm     [--model DIR] [--url http://127.0.0.1:PORT]

embedded: the embedded engine on one batch of prompts x n (with and without routes).
vllm:     the same batch sent to one vLLM server three ways, interleaved round by round so CPU noise hits all
          alike: `raw` = plain concurrent HTTP requests of the same bodies (no megapo code), `client` = VLLMEngine,
          `router` = Router([VLLMEngine]) (one request per prompt), `router_per_sample` (one request per sample). Ratios client/raw and router/raw are reported
          per round and as the median (target >= 0.9). Without --url a server is started (needs .venv-vllm).
Without --model a tiny Qwen3-MoE is written to a temporary folder.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megapo.engines.base import SamplingParams  # noqa: E402


def make_prompts(num_prompts: int, prompt_len: int, vocab: int) -> list[list[int]]:
    return [[(7 * i + 13 * k) % (vocab - 10) + 5 for k in range(prompt_len)] for i in range(num_prompts)]


def count_tokens(out) -> int:
    return sum(len(s.output_ids) for g in out for s in g)


def bench_embedded(args, model_dir: str) -> dict:
    import torch

    from megapo.engines.embedded import EmbeddedEngine

    torch.set_num_threads(args.threads)
    engine = EmbeddedEngine(model_dir)
    prompts = make_prompts(args.prompts, args.prompt_len, engine.spec.vocab_size)
    result = {}
    for routes in (False, True):
        if routes and engine.spec.num_moe_layers == 0:
            continue
        params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, seed=0, return_routes=routes)
        engine.generate(prompts[:2], SamplingParams(max_new_tokens=4))  # warm-up
        rates = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            tokens = count_tokens(engine.generate(prompts, params))
            rates.append(tokens / (time.perf_counter() - t))
        result["tokens_per_s_routes" if routes else "tokens_per_s"] = statistics.median(rates)
        result["rounds_routes" if routes else "rounds"] = rates
    result["params"] = engine.model.num_parameters()
    return result


def raw_load(url: str, prompts, params: SamplingParams, pool: ThreadPoolExecutor) -> int:
    """Plain concurrent HTTP to /inference/v1/generate, the same bodies megapo sends, no megapo code."""
    parts = urlsplit(url)

    def one(i_prompt):
        i, prompt = i_prompt
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
        sp = {"n": params.n, "temperature": params.temperature, "top_p": params.top_p,
              "max_tokens": params.max_new_tokens, "stop_token_ids": [], "ignore_eos": True, "logprobs": 0,
              "detokenize": False, "skip_special_tokens": False, "seed": params.seed + i * params.n}
        conn.request("POST", "/inference/v1/generate", json.dumps({"token_ids": prompt, "sampling_params": sp}),
                     {"Content-Type": "application/json"})
        body = json.loads(conn.getresponse().read())
        conn.close()
        return sum(len(c["token_ids"]) for c in body["choices"])

    return sum(pool.map(one, enumerate(prompts)))


def bench_vllm(args, model_dir: str) -> dict:
    from megapo.engines.router import Router
    from megapo.engines.server import VLLMServer, VLLMServerConfig
    from megapo.engines.vllm import VLLMEngine

    server = None
    url = args.url
    if url is None:
        server = VLLMServer(VLLMServerConfig(model_dir, dtype=args.dtype, cpu_threads=args.threads)).start()
        url = server.url
    try:
        client = VLLMEngine(url)
        router = Router([VLLMEngine(url)])  # one request per prompt (all n samples)
        per_sample = Router([VLLMEngine(url)], samples_per_request=1)
        prompts = make_prompts(args.prompts, args.prompt_len, 500)
        params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, seed=0)
        pool = ThreadPoolExecutor(64)
        runs = {"raw": lambda: raw_load(url, prompts, params, pool),
                "client": lambda: count_tokens(client.generate(prompts, params)),
                "router": lambda: count_tokens(router.generate(prompts, params)),
                "router_per_sample": lambda: count_tokens(per_sample.generate(prompts, params))}
        for fn in runs.values():  # warm-up
            fn()
        rates: dict[str, list[float]] = {k: [] for k in runs}
        # CPU seconds this (client) process spends per 1000 tokens: megapo's own overhead, which unlike wall
        # time is not swamped by other load on a shared machine
        cpu: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.rounds):
            for name, fn in runs.items():
                t, c = time.perf_counter(), time.process_time()
                tokens = fn()
                cpu[name].append(1000 * (time.process_time() - c) / tokens)
                rates[name].append(tokens / (time.perf_counter() - t))
        ratio = {k: [r / raw for r, raw in zip(rates[k], rates["raw"])] for k in rates if k != "raw"}
        return {"url": url, "tokens_per_s": {k: statistics.median(v) for k, v in rates.items()}, "rounds": rates,
                "ratio_vs_raw": {k: statistics.median(v) for k, v in ratio.items()}, "ratio_rounds": ratio,
                "target_ratio": 0.9,
                "client_cpu_s_per_1k_tokens": {k: statistics.median(v) for k, v in cpu.items()}}
    finally:
        if server is not None:
            server.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("embedded", "vllm"), default="embedded")
    p.add_argument("--model", help="HF model folder (default: a tiny Qwen3-MoE written to a temp folder)")
    p.add_argument("--url", help="vllm: a running server instead of starting one")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", help="vllm server dtype")
    p.add_argument("--out", default="rollout_bench.json")
    args = p.parse_args(argv)
    for name in ("prompts", "n", "prompt_len", "max_new_tokens", "rounds", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from megapo.models.tiny import write_tiny_model

            model_dir = str(write_tiny_model(Path(tmp) / "tiny_moe", "qwen3_moe"))
        result = bench_embedded(args, model_dir) if args.engine == "embedded" else bench_vllm(args, model_dir)
    report = {"engine": args.engine, "model": args.model or "tiny qwen3_moe (default write_tiny_model)",
              "batch": {"prompts": args.prompts, "n": args.n, "prompt_len": args.prompt_len,
                        "max_new_tokens": args.max_new_tokens}, "threads": args.threads, **result}
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
