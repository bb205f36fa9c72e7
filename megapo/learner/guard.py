"""Refusing updates that would make the model non-finite.

`UpdateGuard.step` runs Megatron's optimizer step unless it would poison the weights. With a copy kept
(the default), it copies this rank's parameters and optimizer state into buffers it owns (allocated
once, refilled by one fused copy per step), steps, and copies everything back when the gradient norm is
not finite or any parameter is after the step (one fused reduction over them, read once per step,
agreed over all ranks). The copy costs one more set of this rank's parameters and
optimizer state in memory; `keep_copy=False` (optim.restore_nonfinite=false) drops it: a non-finite
gradient norm then skips the step before the optimizer runs (Megatron's norm computed once more), and
non-finite values after the step raise NonFiniteError, there being nothing to undo them with.
"""

from __future__ import annotations

import math

import torch

from megapo.dist import multi_process
from megapo.integrity import NonFiniteError


def _inner_optimizers(optimizer) -> list:
    """The torch optimizers inside Megatron's (chained) optimizer."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [opt.optimizer for opt in chained if getattr(opt, "optimizer", None) is not None]


class UpdateGuard:
    def __init__(self, model: torch.nn.Module, optimizer, keep_copy: bool = True):
        self.model = model
        self.optimizer = optimizer
        self.keep_copy = keep_copy
        self._live: list[torch.Tensor] = []
        self._saved: list[torch.Tensor] = []
        self._stateless: list = []  # (torch optimizer, param) pairs without state before the step

    def _tensors(self) -> list[torch.Tensor]:
        """Every tensor an update writes: model parameters, the optimizer's own (main) parameters and
        their state, each storage once."""
        out, seen = [], set()

        def add(t):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and id(t) not in seen:
                seen.add(id(t))
                out.append(t)

        for p in self.model.parameters():
            add(p)
        for opt in _inner_optimizers(self.optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    add(p)
                    for value in opt.state.get(p, {}).values():
                        add(value)
        return out

    def _parameters(self) -> list[torch.Tensor]:
        out = {id(p): p for p in self.model.parameters()}
        for opt in _inner_optimizers(self.optimizer):
            out.update((id(p), p) for g in opt.param_groups for p in g["params"])
        return list(out.values())

    def step(self) -> tuple[bool, float]:
        """The optimizer step, or nothing of it: (applied, gradient norm). Collective."""
        if not self.keep_copy:
            self.optimizer.prepare_grads()
            norm = float(self.optimizer.get_grad_norm())
            if not math.isfinite(norm):
                return False, norm
            ok, _, _ = self.optimizer.step()
            if not self.all_finite():
                raise NonFiniteError("non-finite parameters after the optimizer step, and no copy kept to "
                                     "undo it (optim.restore_nonfinite=False); stopping before they are saved")
            return bool(ok), norm
        self.before_step()
        ok, norm, _ = self.optimizer.step()
        norm = float("nan") if norm is None else float(norm)
        if ok and math.isfinite(norm) and self.all_finite():
            return True, norm
        self.undo()
        return False, norm

    def before_step(self) -> None:
        """Remember what the step is about to change."""
        self._stateless = [(opt, p) for opt in _inner_optimizers(self.optimizer) for g in opt.param_groups
                           for p in g["params"] if not opt.state.get(p)]
        live = self._tensors()
        if len(live) != len(self._live) or any(a is not b for a, b in zip(live, self._live)):
            self._live = live  # the set changes when Adam creates its state (first step)
            self._saved = [torch.empty_like(t, requires_grad=False) for t in live]
        with torch.no_grad():
            torch._foreach_copy_(self._saved, self._live)

    def all_finite(self) -> bool:
        """Whether every parameter (the model's and the optimizer's main copies) is finite on every rank
        (collective). Adam's moments need no check: with a finite gradient norm they stay finite (g^2
        overflows only for |g| > 1e19, which makes the norm inf), and non-finite ones would show in the
        parameters they update."""
        tensors = self._parameters()
        with torch.no_grad():  # the 2-norm: fused and fast; it also overflows for a value above ~1e19 (poisoned too)
            total = torch.stack(torch._foreach_norm(tensors, 2)).sum() if tensors else torch.zeros(())
        bad = (~torch.isfinite(total)).to(torch.float32).reshape(1)
        if multi_process():  # `bad` lives on the parameters' device, which the group reduces (NCCL: CUDA)
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        return not bool(bad.item())

    def undo(self) -> None:
        """Put back what before_step saw: values, and no state where there was none."""
        for opt, p in self._stateless:
            opt.state.pop(p, None)
        saved = {id(t): s for t, s in zip(self._live, self._saved)}
        live = [t for t in self._tensors() if id(t) in saved]
        with torch.no_grad():
            torch._foreach_copy_(live, [saved[id(t)] for t in live])
