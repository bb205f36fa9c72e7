"""A vLLM worker extension (`--worker-extension-cls megapo.engines.vllm_worker.MegapoWorkerExtension`).

Runs inside vLLM's worker process (the .venv-vllm environment), so it imports nothing from megapo.

Why: on CPU, vLLM 0.32.0 prepacks unquantized MoE expert weights into its grouped-GEMM layout only on the
first load. `reload_weights` re-runs the layer's weight processing, but the MoE method skips the CPU prepack
when its kernel already exists, so reloaded experts sit unpacked in a buffer the kernel reads as packed
(log-prob error ~4e-2). `megapo_reload_weights` reloads and then re-applies the prepack, in place, to exactly
the expert tensors the reload rewrote (a partial checkpoint leaves the other layers packed and untouched).
"""

from __future__ import annotations


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
        import torch
        from vllm._custom_ops import cpu_prepack_moe_weight

        layers = cpu_moe_layers(self.model_runner.get_model()) if self.device.type == "cpu" else []
        names = ("w13_weight", "w2_weight")
        before = [[getattr(m, n).detach().clone() for n in names] for m, _ in layers]
        self.reload_weights(weights_path=weights_path)
        repacked = 0
        with torch.no_grad():
            for (module, experts), old in zip(layers, before):
                for name, old_t in zip(names, old):
                    weight = getattr(module, name)
                    if not torch.equal(weight.data, old_t):  # rewritten by the reload: raw layout
                        weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))
                        repacked += 1
        return repacked
