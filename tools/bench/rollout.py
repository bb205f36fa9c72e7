"""Rollout throughput benchmark (not a test): generated tokens/s, written as JSON.

  python tools/bench/rollout.py --engine embedded [--model DIR] [--out rollout.json]
  python tools/bench/rollout.py --engine vllm     [--model DIR] [--url http://127.0.0.1:PORT]

embedded: the embedded engine on one batch of prompts x n (with and without routes).
vllm:     the same batch sent to one vLLM server several ways: `raw` = plain concurrent HTTP requests of the same
          bodies (kept-alive connections, no megapo code), `raw_control` = the same again (an A/A check: its ratio
          shows the design's noise), `client` = VLLMEngine, `router` = Router([VLLMEngine]) (one request per
          prompt), `router_per_sample` (one request per sample). After --warmup unmeasured rounds, each of --rounds
          rounds runs every way once in a random order, each run between two raw runs; the ratio way/raw (to the
          geometric mean of those two raw runs) is reported as median, quartiles and a bootstrap 95% interval of
          the median (target >= 0.9), with the ratio of the 90th-percentile tokens/s. Also per way: vLLM engine
          steps per run (equal steps = the server did the same work), CPU seconds per 1k tokens of the client
          process and of the server's processes, and the throughput ratio they imply on a CPU-bound machine.
          Without --url a server is started (needs .venv-vllm).
Without --model a tiny Qwen3-MoE is written to a temporary folder.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megapo.engines.auth import bearer, read_key_file  # noqa: E402
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


class RawLoad:
    """The plainest fast client: concurrent HTTP to /inference/v1/generate with the same bodies megapo sends, one
    kept-alive connection per thread, no megapo code. The reference megapo's client and router must keep up with."""

    def __init__(self, url: str, threads: int = 64, api_key: str | None = None):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        self.headers = {"Content-Type": "application/json", **bearer(api_key)}
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="raw")
        self.local = threading.local()

    def _post(self, body: bytes) -> dict:
        for attempt in range(2):
            conn = getattr(self.local, "conn", None) or http.client.HTTPConnection(self.host, self.port, timeout=600)
            self.local.conn = conn
            try:
                conn.request("POST", "/inference/v1/generate", body, self.headers)
                return json.loads(conn.getresponse().read())
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                conn.close()
                self.local.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def run(self, prompts, params: SamplingParams) -> int:
        def one(i_prompt):
            i, prompt = i_prompt
            sp = {"n": params.n, "temperature": params.temperature, "top_p": params.top_p,
                  "max_tokens": params.max_new_tokens, "stop_token_ids": [], "ignore_eos": True, "logprobs": 0,
                  "detokenize": False, "skip_special_tokens": False, "seed": params.seed + i * params.n}
            body = self._post(json.dumps({"token_ids": prompt, "sampling_params": sp, "output_mode": "tokens"}).encode())
            return sum(len(c["token_ids"]) for c in body["choices"])

        return sum(self.pool.map(one, enumerate(prompts)))


def process_tree_cpu(pid: int | None) -> float:
    """CPU seconds used so far by a process and its children (the vLLM server: API, engine core, worker)."""
    if pid is None:
        return float("nan")
    import psutil

    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return float("nan")
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def engine_steps(url: str, api_key: str | None = None) -> float:
    """vLLM's count of engine steps so far (/metrics). Steps per batch show how well a client feeds the server:
    requests that arrive together share every step, staggered ones need extra steps, whatever the CPU load."""
    with urllib.request.urlopen(urllib.request.Request(url + "/metrics", headers=bearer(api_key)), timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:iteration_tokens_total_count"):
                return float(line.rsplit(" ", 1)[1])
    return float("nan")


def quantiles(values: list[float]) -> dict:
    """median, quartiles and a bootstrap 95% interval of the median (seeded, so the report is reproducible)."""
    v = sorted(values)
    q = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0]] * 3
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(v, k=len(v))) for _ in range(2000))
    return {"median": statistics.median(v), "p25": q[0], "p75": q[2], "min": v[0], "max": v[-1],
            "median_ci95": [boot[49], boot[1949]]}


def bench_vllm(args, model_dir: str) -> dict:
    from megapo.engines.router import Router
    from megapo.engines.server import VLLMServer, VLLMServerConfig
    from megapo.engines.vllm import VLLMEngine

    server = None
    url, key = args.url, read_key_file(args.api_key_file, "--api-key-file") if args.api_key_file else None
    if url is None:
        server = VLLMServer(VLLMServerConfig(model_dir, dtype=args.dtype)).start()
        url, key = server.url, server.api_key
    server_pid = server.process.pid if server is not None else None
    try:
        raw = RawLoad(url, api_key=key)
        client = VLLMEngine(url, api_key=key)
        router = Router([VLLMEngine(url, api_key=key)])  # one request per prompt (all n samples)
        per_sample = Router([VLLMEngine(url, api_key=key)], samples_per_request=1)
        prompts = make_prompts(args.prompts, args.prompt_len, 500)
        params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, seed=0)
        control = RawLoad(url, api_key=key)
        runs = {"raw": lambda: raw.run(prompts, params),
                # the raw load again (its own pool and connections): an A/A check of the design, whose ratio
                # should come out 1 up to the noise of the shared CPU
                "raw_control": lambda: control.run(prompts, params),
                "client": lambda: count_tokens(client.generate(prompts, params)),
                "router": lambda: count_tokens(router.generate(prompts, params)),
                "router_per_sample": lambda: count_tokens(per_sample.generate(prompts, params))}
        for _ in range(args.warmup):  # connections, server-side caches and compilation: not measured
            for fn in runs.values():
                fn()
        load_before = os.getloadavg()

        def measure(name: str) -> dict:
            # CPU seconds per 1000 tokens, of this (client) process and of the server's process tree: megapo's
            # own overhead, and the server work its requests cause
            steps, sc = engine_steps(url, key), process_tree_cpu(server_pid)
            t, c = time.perf_counter(), time.process_time()
            tokens = runs[name]()
            wall = time.perf_counter() - t
            return {"way": name, "tokens_per_s": tokens / wall, "client_cpu": 1000 * (time.process_time() - c) / tokens,
                    "server_cpu": 1000 * (process_tree_cpu(server_pid) - sc) / tokens,
                    "engine_steps": engine_steps(url, key) - steps}

        # The load of a shared CPU drifts on a scale of seconds, so every run of a megapo way is bracketed by two
        # raw runs (raw, A, raw, B, raw, ...; the ways in a fresh random order each round) and compared with
        # their geometric mean: the ratio sees the load of the same two seconds.
        rng = random.Random(args.seed)
        ways = [k for k in runs if k != "raw"]
        log = [measure("raw")]
        ratio: dict[str, list[float]] = {k: [] for k in ways}
        cpu_ratio: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(args.rounds):
            order = list(ways)
            rng.shuffle(order)
            for name in order:
                before, run, after = log[-1], measure(name), measure("raw")
                log += [run, after]
                ratio[name].append(run["tokens_per_s"] / (before["tokens_per_s"] * after["tokens_per_s"]) ** 0.5)
                # tokens per CPU-second of client + server, relative to raw: the throughput ratio of a CPU-bound
                # machine
                raw_cpu = [r["client_cpu"] + r["server_cpu"] for r in (before, after)]
                cpu_ratio[name].append((raw_cpu[0] * raw_cpu[1]) ** 0.5 / (run["client_cpu"] + run["server_cpu"]))
        load_after = os.getloadavg()
        by_way = {k: [r for r in log if r["way"] == k] for k in runs}

        def p90(way: str) -> float:  # a run little disturbed by other load: the speed the way can reach
            return statistics.quantiles([r["tokens_per_s"] for r in by_way[way]], n=10, method="inclusive")[-1]

        def cpu_per_1k(way: str) -> float:
            return statistics.median(r["client_cpu"] + r["server_cpu"] for r in by_way[way])

        for c in (client, router, per_sample):
            c.close()
        return {"url": url, "server_started_by_bench": server is not None, "warmup_rounds": args.warmup,
                "design": "raw, A, raw, B, raw, ... (ways shuffled per round); ratio = way / geometric mean of the "
                          "raw runs just before and after it",
                "ratio_vs_raw": {k: quantiles(v) for k, v in ratio.items()}, "target_ratio": 0.9,
                "cpu_ratio_vs_raw": {k: quantiles(v) for k, v in cpu_ratio.items()},
                "p90_tokens_per_s_ratio_vs_raw": {k: p90(k) / p90("raw") for k in ways},
                # if the machine were CPU-bound on this work alone: raw's CPU (client + server) per token over the
                # way's, from the medians of all runs (valid when the engine steps per run agree)
                "cpu_bound_ratio_vs_raw": {k: cpu_per_1k("raw") / cpu_per_1k(k) for k in ways},
                "tokens_per_s": {k: quantiles([r["tokens_per_s"] for r in v]) for k, v in by_way.items()},
                "client_cpu_s_per_1k_tokens": {k: quantiles([r["client_cpu"] for r in v]) for k, v in by_way.items()},
                "server_cpu_s_per_1k_tokens": {k: quantiles([r["server_cpu"] for r in v]) for k, v in by_way.items()},
                "engine_steps_per_run": {k: quantiles([r["engine_steps"] for r in v]) for k, v in by_way.items()},
                "loadavg_1_5_15": {"before": load_before, "after": load_after},
                "ratio_rounds": ratio, "cpu_ratio_rounds": cpu_ratio, "runs": log}
    finally:
        if server is not None:
            server.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("embedded", "vllm"), default="embedded")
    p.add_argument("--model", help="HF model folder (default: a tiny Qwen3-MoE written to a temp folder)")
    p.add_argument("--url", help="vllm: a running server instead of starting one")
    p.add_argument("--api-key-file", help="vllm with --url: the server's API key file (megapo serve's)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="measured rounds (vllm: each runs every way once)")
    p.add_argument("--warmup", type=int, default=1, help="vllm: unmeasured rounds first")
    p.add_argument("--seed", type=int, default=0, help="vllm: seed of the per-round random order")
    p.add_argument("--note", default="", help="free text stored in the JSON (e.g. what else ran on the machine)")
    p.add_argument("--threads", type=int, default=2, help="embedded: torch threads")
    p.add_argument("--dtype", default="bfloat16", help="vllm server dtype")
    p.add_argument("--out", default="rollout_bench.json")
    args = p.parse_args(argv)
    for name in ("prompts", "n", "prompt_len", "max_new_tokens", "rounds", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from megapo.models.tiny import write_tiny_model

            model_dir = str(write_tiny_model(Path(tmp) / "tiny_moe", "qwen3_moe"))
        result = bench_embedded(args, model_dir) if args.engine == "embedded" else bench_vllm(args, model_dir)
    report = {"engine": args.engine, "model": args.model or "tiny qwen3_moe (default write_tiny_model)",
              "batch": {"prompts": args.prompts, "n": args.n, "prompt_len": args.prompt_len,
                        "max_new_tokens": args.max_new_tokens}, "threads": args.threads,
              "machine": {"cpu_count": os.cpu_count(), "omp_num_threads_client": os.environ.get("OMP_NUM_THREADS"),
                          "note": args.note}, **result}
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
