"""The `rollout` section of the run config (RolloutConfig) and the rules inside it.

Every rule about an engine asks its capabilities (megapo.engines.registry), never its name, and raises ConfigError
naming the dotted field. Rules that read other sections (group size against the advantage, partial rollouts
against train.mode, r3 against the engine's routes) are RunConfig's (megapo/trainer/config.py). The registry is
imported inside the functions: it imports torch, and reading a config does not need it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from megapo.config import ConfigError, bounded

WEIGHT_SYNC = ("tensor", "disk", "broadcast")
SERVER_DTYPES = ("bfloat16", "float16", "float32")  # rollout.dtype (or auto): what vLLM's --dtype takes
# train.precision -> the engine's dtype for rollout.dtype=auto (fp32: the engine's own default). The same table
# as megapo.learner.precision.ENGINE_DTYPES, which cannot be imported here (the learner imports the engines);
# tests/test_config.py keeps the two equal.
PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
SERVERS_FILE = "rollout.servers_file"


def read_servers_file(path: str | Path, field: str = SERVERS_FILE) -> list[str]:
    """The host:port lines of a servers file (blank lines and # comments skipped), in order, without repeats.
    ConfigError naming the field (and file:line) for a missing file or a malformed line."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(field, f"cannot read {path}: {err.strerror or err}") from None
    servers: list[str] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        host, sep, port = line.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(field, f"{path}:{lineno}: expected host:port, got {line!r}")
        if line not in servers:
            servers.append(line)
    return servers


@dataclass
class RolloutConfig:
    """How responses are generated, and how new weights reach the engine."""

    # embedded (megapo's PyTorch model in the trainer's process) | vllm | sglang (megapo.engines.registry: what
    # each can do; megapo/trainer/engine_setup.py: how the trainer builds it)
    engine: str = "embedded"
    servers: list[str] = field(default_factory=list)  # host:port of running vLLM/SGLang servers
    # the elastic fleet: a file of host:port lines (# comments), read at the start and again at every weight sync;
    # servers added to it join the run (they serve once they hold the current weights), servers removed from it
    # leave (megapo/trainer/fleet.py); the run's servers are rollout.servers plus the file's
    servers_file: str = ""
    # the longest a weight sync waits: a server that does not finish it in time (dead, stuck) is dropped and the
    # sync completes for the others (a broadcast group is formed again without it); a sync that cannot finish by
    # then is an error. Broadcast groups time out each operation after a third of it.
    sync_timeout_s: float = bounded(600.0, "> 0")
    host: str = "127.0.0.1"  # the address a vLLM server megapo starts itself listens on (no rollout.servers)
    n_samples: int = bounded(8, ">= 1")  # responses per prompt (the group size)
    temperature: float = bounded(1.0, "> 0")  # sampling temperature
    top_p: float = bounded(1.0, "(0, 1]")  # nucleus sampling: the probability mass kept
    max_new_tokens: int = bounded(64, ">= 1")  # most tokens per response; a longer one is cut (truncated)
    # partial rollouts (train.mode=async): a weight update preempts the batch in flight, whose samples keep their
    # tokens and continue on the new weights (each token records its version: Sample.token_versions), instead of
    # the learner waiting for the batch (the fixed schedule of megapo.trainer.async_rollout)
    partial: bool = False
    # partial rollouts: the most weight versions one response may span; one that would span more starts again on
    # the newest weights
    partial_max_versions: int = bounded(2, ">= 2")
    # how new weights reach the engine: tensor (handed over in the process) | disk (safetensors the servers
    # reload) | broadcast (a collective group with vLLM's workers); which engine takes which: its capabilities
    weight_sync: str = "tensor"
    bucket_mb: int = bounded(512, ">= 1")  # weight sync sends the tensors in buckets of at most this many MB
    # broadcast: where the servers' workers meet the learner's stage roots (host: an address of the learner's
    # rank-0 node the servers can reach, set by the Slurm templates; port 0: a free one picked at start;
    # stage s uses port + s)
    sync_host: str = "127.0.0.1"
    sync_port: int = bounded(0, "[0, 65535]", "0: a free port")  # broadcast: the first stage root's port
    # compute dtype of the embedded engine and of a vLLM server megapo starts itself (rollout.engine=vllm, no
    # rollout.servers); auto: the learner's (train.precision) when it is bf16 or fp16; with an fp32 learner the
    # engine's own default: float32 for the embedded engine (its log-probs and routes match the learner's),
    # bfloat16 for vLLM. float32 makes a server's log-probs match the learner's to ~1e-6 (tests, mismatch
    # studies); a lower one makes a real train-inference mismatch for the embedded engine.
    dtype: str = "auto"
    # file holding the API key of the vLLM servers in rollout.servers (the file `megapo serve` was given or
    # printed; the Slurm template makes one per job); required with vLLM servers, mode 600
    api_key_file: str = ""
    # σ of N(0, σ²) noise the engine adds to every MoE router's logits before its top-k (softmax routers: before
    # the softmax; sigmoid routers: before the sigmoid), so the noise moves both the choice of experts and their
    # gates; the learner routes without it. Simulates kernel-level router nondeterminism (a bf16 GPU engine
    # routing tokens unlike the learner) as a controlled dose: router/disagree grows with it. The engine samples
    # from, and reports the log-probs and routes of, the experts it used; drawn from a generator seeded by
    # train.seed (kept in checkpoints); the held-out evaluation on the engine sees it too. Engines whose
    # capabilities say router_noise (embedded); MoE models only.
    router_noise: float = bounded(0.0, ">= 0", "0: off")
    # HAPO's entropy-adaptive sampling temperature (Liu et al. 2025, arXiv:2509.16591; the authors' τ 0.05): each
    # token drawn at temperature·(1 + τ·ĥ), ĥ in [-1, 1] its next-token entropy scored against the last train batch's
    # π_old entropies (megapo.engines.base.EntropyTemperature; the first step at the plain temperature). The
    # statistics are kept in checkpoints. Engines whose capabilities say adaptive_temperature (embedded);
    # train.mode sync only.
    adaptive_temperature: float = bounded(0.0, "[0, 1)", "0: off")

    def compute_dtype(self, precision: str = "fp32") -> str:
        """rollout.dtype with auto resolved for this engine and the learner's train.precision."""
        from megapo.engines.registry import capabilities  # lazy: the engines' module imports torch

        if self.dtype != "auto":
            return self.dtype
        return PRECISION_DTYPES[precision] if precision != "fp32" else capabilities(self.engine).default_dtype

    def has_servers(self) -> bool:
        """Whether the run names running servers (rollout.servers or rollout.servers_file)."""
        return bool(self.servers or self.servers_file)

    def run_servers(self) -> list[str]:
        """rollout.servers, then the lines of rollout.servers_file (the fleet at the start)."""
        listed = read_servers_file(self.servers_file) if self.servers_file else []
        return list(dict.fromkeys(self.servers + listed))

    # --- the rules inside the section ------------------------------------------------------------

    def validate(self) -> None:
        """The engine and what its capabilities allow; the first violated rule raises ConfigError naming its field."""
        from megapo.engines.registry import capabilities

        try:
            caps = capabilities(self.engine)
        except ValueError as err:  # the registry's "unknown engine ...; choose from ..."
            raise ConfigError("rollout.engine", str(err)) from None
        if self.router_noise > 0 and not caps.router_noise:
            raise ConfigError("rollout.router_noise", f"engine {self.engine!r} cannot add noise to its routers (the "
                              "embedded engine can); set it to 0")
        if self.adaptive_temperature > 0 and not caps.adaptive_temperature:
            raise ConfigError("rollout.adaptive_temperature", f"engine {self.engine!r} samples at one temperature "
                              "per request (the embedded engine can give each token its own); set it to 0")
        self._check_servers(caps)
        self._check_api_key_file(caps)
        if self.weight_sync not in WEIGHT_SYNC:
            raise ConfigError("rollout.weight_sync", f"must be one of {', '.join(WEIGHT_SYNC)}, got {self.weight_sync!r}")
        if self.weight_sync not in caps.weight_syncs:
            raise ConfigError("rollout.weight_sync", f"engine {self.engine!r} supports {', '.join(caps.weight_syncs)}, "
                              f"not {self.weight_sync!r}")
        if self.dtype not in ("auto",) + SERVER_DTYPES:
            raise ConfigError("rollout.dtype", f"must be auto or one of {', '.join(SERVER_DTYPES)}, got {self.dtype!r}")
        if self.partial and not caps.partial:
            raise ConfigError("rollout.partial", f"engine {self.engine!r} cannot preempt and continue a batch yet "
                              "(the embedded and vllm engines can)")

    def _check_servers(self, caps) -> None:
        """servers_file needs a server engine and one server to start; an engine megapo does not start needs
        servers; each server is host:port."""
        from megapo.engines.registry import needs_servers

        if self.servers_file:
            if caps.in_process:
                raise ConfigError("rollout.servers_file", f"rollout.engine={self.engine} runs in the trainer's "
                                  "process; a fleet of servers needs a server engine (vllm, sglang)")
            if not (self.servers or read_servers_file(self.servers_file)):
                raise ConfigError("rollout.servers_file", f"{self.servers_file} lists no server and rollout.servers "
                                  "is empty: the run needs one to start")
        if needs_servers(self.engine) and not self.has_servers():
            raise ConfigError("rollout.servers", f"rollout.engine={self.engine} needs running servers (host:port); "
                              "megapo starts only vLLM servers itself")
        if not caps.in_process:
            for i, server in enumerate(self.servers):
                host, sep, port = server.rpartition(":")
                if not sep or not host or not port.isdigit():
                    raise ConfigError(f"rollout.servers[{i}]", f"expected host:port, got {server!r}")

    def _check_api_key_file(self, caps) -> None:
        """Servers that answer only requests with their key (vLLM's, megapo serve): the trainer needs the key
        file; a file that exists must be private (megapo serve creates a missing one)."""
        from megapo.engines.auth import read_key_file

        if caps.api_key and self.has_servers() and not self.api_key_file:
            raise ConfigError("rollout.api_key_file", "is required with vLLM rollout.servers: megapo serve's servers "
                              "refuse requests without their key (the file megapo serve was given or printed)")
        if self.api_key_file and (self.has_servers() or Path(self.api_key_file).exists()):
            try:
                read_key_file(self.api_key_file, "rollout.api_key_file")
            except (OSError, ValueError) as err:
                raise ConfigError("rollout.api_key_file", str(err).removeprefix("rollout.api_key_file: ")) from None



def plain_model_error(hf: dict) -> str | None:
    """Why megapo's in-process PyTorch model (megapo.engines.torch_lm) cannot run config.json `hf`, or None."""
    from megapo.engines.torch_lm import TorchLMSpec

    try:
        TorchLMSpec.from_config(hf)
    except (ValueError, KeyError) as err:
        return err.args[0] if isinstance(err, ValueError) else f"it has no field {err}"
    return None
