"""The learner's numeric precision: what its parameters and activations are computed in, on Megatron's own
machinery (mixed precision as Megatron-LM trains).

- fp32: everything in float32 (the CPU default; exact against transformers' fp32 forward).
- bf16 / fp16: parameters and activations in that dtype (Megatron's Float16Module: the first pipeline stage
  casts its inputs, the last returns fp32 logits, from which log-probs and entropy are computed in fp32);
  the router in fp32 (moe_router_dtype); gradients reduced and accumulated in fp32 (DDP's main_grad
  buffers); the optimizer keeps fp32 main parameters and Adam moments (plain or distributed optimizer),
  steps them, and writes their rounding back into the model. Checkpoints hold the fp32 main parameters,
  so a resumed run continues from them, never from rounded weights.
- fp16 only: Megatron's dynamic loss scaler multiplies the loss before backward; a step whose gradients
  overflow is skipped (weights and optimizer state untouched) and the scale shrinks; the scaler's state
  is in the checkpoint.
- FP8 (bf16 only, Transformer Engine on a GPU): TE's FP8 GEMMs in the linear layers, with a format
  (e4m3 everywhere, or hybrid: e4m3 forward, e5m2 gradients) and a scaling recipe, passed to TE through
  Megatron's TransformerConfig.

    p = Precision("bf16")
    p.validate("train")           # ConfigError naming train.precision / train.fp8 / train.fp8_recipe
    p.dtype                        # torch.bfloat16
"""

from __future__ import annotations

from dataclasses import dataclass

from megapo.config import ConfigError

# each precision's torch dtype name, which is also what an engine (vLLM's --dtype, the embedded engine) takes
ENGINE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
PRECISIONS = tuple(ENGINE_DTYPES)
FP8_FORMATS = ("none", "e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


@dataclass(frozen=True)
class Precision:
    params: str = "fp32"  # fp32 | bf16 | fp16: parameters and activations (fp32 main parameters otherwise)
    fp8: str = "none"  # none | e4m3 | hybrid (Transformer Engine's FP8 GEMMs; bf16 only)
    fp8_recipe: str = "delayed"  # delayed | tensorwise | blockwise | mxfp8 (TE's scaling recipe)
    # fp16's dynamic loss scaler (Megatron's DynamicGradScaler): the first scale, the clean steps after which
    # it doubles, and the overflowing steps in a row after which it halves
    initial_loss_scale: float = 2.0 ** 16
    loss_scale_window: int = 1000
    loss_scale_hysteresis: int = 2

    @property
    def dtype(self):
        """The torch dtype of the model's parameters and activations."""
        import torch  # lazy: the run config imports this module

        return getattr(torch, ENGINE_DTYPES[self.params])

    @property
    def mixed(self) -> bool:
        """Parameters in half precision with fp32 main parameters in the optimizer."""
        return self.params != "fp32"

    @property
    def engine_dtype(self) -> str:
        """The dtype name of an engine computing in the learner's precision."""
        return ENGINE_DTYPES[self.params]

    def validate(self, prefix: str = "train") -> None:
        if self.params not in PRECISIONS:
            raise ConfigError(f"{prefix}.precision", f"must be one of {', '.join(PRECISIONS)}, got {self.params!r}")
        if self.fp8 not in FP8_FORMATS:
            raise ConfigError(f"{prefix}.fp8", f"must be one of {', '.join(FP8_FORMATS)}, got {self.fp8!r}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ConfigError(f"{prefix}.fp8_recipe", f"must be one of {', '.join(FP8_RECIPES)}, got {self.fp8_recipe!r}")
        if self.fp8 != "none" and self.params != "bf16":
            raise ConfigError(f"{prefix}.fp8", f"{self.fp8}: FP8 runs only with {prefix}.precision=bf16 "
                                               f"(got {self.params})")
        if self.initial_loss_scale <= 0 or self.loss_scale_window < 1 or self.loss_scale_hysteresis < 1:
            raise ConfigError(f"{prefix}.precision", "the loss scaler needs initial_loss_scale > 0, "
                                                     "loss_scale_window >= 1 and loss_scale_hysteresis >= 1")

    def check_hardware(self, prefix: str = "train", use_te: bool | None = None) -> None:
        """FP8 needs Transformer Engine on a GPU (`use_te`: whether the learner's backend has it; None: look)."""
        if self.fp8 == "none":
            return
        if use_te is None:
            from megapo.learner.backend import detect_backend

            use_te = detect_backend().use_te
        if not use_te:
            raise ConfigError(f"{prefix}.fp8", f"{self.fp8}: FP8 needs Transformer Engine on a GPU, and this machine "
                                               "has no GPU or no Transformer Engine")

    def transformer_fields(self) -> dict:
        """Megatron TransformerConfig fields (the router stays fp32: moe_router_dtype, set by the model)."""
        fields = dict(params_dtype=self.dtype, pipeline_dtype=self.dtype, bf16=self.params == "bf16",
                      fp16=self.params == "fp16")
        if self.fp8 != "none":
            fields.update(fp8=self.fp8, fp8_recipe=self.fp8_recipe)
        return fields

    def optimizer_fields(self) -> dict:
        """Megatron OptimizerConfig fields: fp32 main parameters for bf16/fp16, the dynamic scaler for fp16."""
        fields = dict(bf16=self.params == "bf16", fp16=self.params == "fp16", params_dtype=self.dtype)
        if self.params == "fp16":
            fields.update(initial_loss_scale=self.initial_loss_scale, min_loss_scale=1.0,
                          loss_scale_window=self.loss_scale_window, hysteresis=self.loss_scale_hysteresis)
        return fields


def precision_named(name: str, field: str = "--precision") -> Precision:
    """A Precision for a command-line flag (fp32 | bf16 | fp16), or a ConfigError naming the flag."""
    if name not in PRECISIONS:
        raise ConfigError(field, f"must be one of {', '.join(PRECISIONS)}, got {name!r}")
    return Precision(name)
