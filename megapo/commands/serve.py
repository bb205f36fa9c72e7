"""`megapo serve`: start a vLLM server that megapo's VLLMEngine (or a Router over several) can use.

  megapo serve --model DIR [--host 127.0.0.1] [--port 8000] [--dtype bfloat16] [--max-model-len 2048]
               [--cpu-cores 0-7] [--api-key-file F] [--weights-dir D ...]
  megapo serve CONFIG.yaml [--host H --allow-remote] [--port P] [section.field=value ...]   # as slurm does

With a run config, the model is model.path, the context length the run's longest prompt plus response, the
dtype rollout.dtype (the same server megapo starts itself for rollout.engine=vllm without rollout.servers), the
API key file rollout.api_key_file and the weights folders train.output_dir and model.path. The config must name
rollout.engine=vllm. Runs until interrupted (SIGINT or SIGTERM). vLLM comes from its own venv
(scripts/vllm_setup.sh), never megapo's .venv.

Every request but GET /health needs the API key in the key file (created, mode 600, if missing; without one, a
fresh key in a private temporary folder whose path is printed): give the trainer that file as
rollout.api_key_file. Only loopback addresses are bound unless --allow-remote (then a key file must be named).
A taken --port is refused before anything starts (exit 2).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

INTERMIXED_ARGS = True  # megapo.cli: the overrides may follow --host/--port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=None, help="run config (YAML); model from model.path")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the run config, e.g. model.path=DIR")
    parser.add_argument("--model", default=None, help="HF model folder (config.json + safetensors), instead of CONFIG")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    parser.add_argument("--allow-remote", action="store_true",
                        help="allow a --host other machines reach (needs an API key file the trainer reads too)")
    parser.add_argument("--api-key-file", default=None,
                        help="file holding the server's API key, created (mode 600) if missing (default: "
                             "rollout.api_key_file of CONFIG, else a new key in a private temporary folder)")
    parser.add_argument("--weights-dir", action="append", default=None,
                        help="folder the trainer may reload weights from (repeatable; default: train.output_dir "
                             "and model.path of CONFIG, else the --model folder)")
    parser.add_argument("--port", type=int, default=None, help="default: a free port")
    parser.add_argument("--dtype", default=None, help="default: rollout.dtype of CONFIG, else bfloat16")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: from CONFIG, else 2048")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="CPU KV cache size (VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--cpu-cores", default=None,
                        help="CPU cores the worker computes on (VLLM_CPU_OMP_THREADS_BIND, e.g. 0-7); give each "
                             "server on a machine its own (default: vLLM's auto binding, the same for all)")
    parser.add_argument("--venv", default=None, help="vLLM venv (default <repo>/.venv-vllm)")
    parser.add_argument("--log", default=None, help="server log file")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for readiness")


def _served(args: argparse.Namespace) -> dict:
    """What to serve (VLLMServerConfig's model_dir, max_model_len, dtype, api_key_file, weights_dirs) from --model
    or the run config; errors name the argument."""
    from megapo.config import ConfigError
    from megapo.engines.server import VLLMServerConfig

    if (args.model is None) == (args.config is None):
        raise ConfigError("--model", "give exactly one of --model DIR or CONFIG")
    if args.model is not None:
        if args.overrides:
            raise ConfigError("--model", f"overrides {args.overrides} need a CONFIG (with --model there is no config)")
        return {"model_dir": args.model, "max_model_len": args.max_model_len or 2048,
                "dtype": args.dtype or VLLMServerConfig.dtype, "api_key_file": args.api_key_file,
                "weights_dirs": args.weights_dir or [args.model]}
    from megapo.config import load_config
    from megapo.trainer.config import RunConfig
    from megapo.trainer.engine_setup import server_max_model_len

    cfg = load_config(RunConfig, args.config, args.overrides)
    if cfg.rollout.engine != "vllm":
        raise ConfigError("rollout.engine", f"megapo serve starts vLLM; the config says {cfg.rollout.engine!r}")
    return {"model_dir": cfg.model.path, "max_model_len": args.max_model_len or server_max_model_len(cfg),
            "dtype": args.dtype or cfg.rollout.compute_dtype(cfg.train.precision),
            "api_key_file": args.api_key_file or cfg.rollout.api_key_file or None,
            "weights_dirs": args.weights_dir or [cfg.train.output_dir, cfg.model.path]}


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _server(args: argparse.Namespace, served: dict):
    """The VLLMServer, nothing started; its refusals of what the command line gave (a bind or port that cannot be
    used, a bad key file, no config.json, no vLLM venv) as ConfigError: megapo.cli reports them (exit 2)."""
    from megapo.config import ConfigError
    from megapo.engines.server import VLLMServer, VLLMServerConfig, is_loopback

    if args.allow_remote and not is_loopback(args.host) and not served.get("api_key_file"):
        raise ConfigError("--api-key-file", f"--host {args.host} --allow-remote needs a key file the trainer on the "
                          "other machine reads too (its rollout.api_key_file); give --api-key-file, or "
                          "rollout.api_key_file in CONFIG")
    try:
        return VLLMServer(VLLMServerConfig(
            **served, host=args.host, port=args.port, venv=args.venv, kv_cache_gib=args.kv_cache_gib,
            cpu_cores=args.cpu_cores, log_path=args.log, allow_remote=args.allow_remote))
    except (ValueError, OSError) as exc:  # VLLMServerConfig's / VLLMServer's checks (the library's errors)
        raise ConfigError("", str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from megapo.config import ConfigError
    from megapo.engines.server import PortInUse, ServerError

    served = _served(args)
    server = _server(args, served)
    # Slurm stops the engine step with SIGTERM: turn it into the same clean stop as Ctrl-C
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.start(timeout=args.timeout)
        print(f"vLLM serving {served['model_dir']} at {server.url} (API key file: {server.api_key_file}, give "
              f"it to the trainer as rollout.api_key_file; log: {server.log_path}); Ctrl-C to stop", flush=True)
        while server.process.poll() is None:
            time.sleep(1.0)
        print(f"server exited with code {server.process.returncode}; last log lines:\n{server.tail()}")
        return 1
    except PortInUse as exc:  # the port was taken between the check and the start
        raise ConfigError("", str(exc)) from None
    except ServerError as exc:
        print(f"megapo serve: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()
