"""`megapo serve`: start a vLLM server that megapo's VLLMEngine (or a Router over several) can use.

  megapo serve --model DIR [--host 127.0.0.1] [--port 8000] [--dtype bfloat16] [--max-model-len 2048]

Runs until interrupted. vLLM comes from its own venv (scripts/vllm_setup.sh), never megapo's .venv.
"""

from __future__ import annotations

import argparse
import time

from megapo.engines.server import VLLMServer, VLLMServerConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF model folder (config.json + safetensors)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    parser.add_argument("--port", type=int, default=None, help="default: a free port")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="CPU KV cache size (VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--venv", default=None, help="vLLM venv (default <repo>/.venv-vllm)")
    parser.add_argument("--log", default=None, help="server log file")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for readiness")


def run(args: argparse.Namespace) -> int:
    server = VLLMServer(VLLMServerConfig(
        args.model, host=args.host, port=args.port, venv=args.venv, dtype=args.dtype,
        max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib, log_path=args.log))
    server.start(timeout=args.timeout)
    print(f"vLLM serving {args.model} at {server.url} (log: {server.log_path}); Ctrl-C to stop", flush=True)
    try:
        while server.process.poll() is None:
            time.sleep(1.0)
        print(f"server exited with code {server.process.returncode}; last log lines:\n{server.tail()}")
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()
