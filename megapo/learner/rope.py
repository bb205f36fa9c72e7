"""Rotary positions that follow explicit position ids, for packed rows on Megatron's local spec.

Megatron's RotaryEmbedding gives token i of a row the angle of position i. In a packed row (several
sequences concatenated, position ids restarting at 0 for each) that is wrong for every sequence but
the first. Transformer Engine handles packing with THD/cu_seqlens; the local spec has no such path, so
the learner stores the row's position ids on the model's rotary module before each forward, and
this subclass returns the angles of those positions, per row of a [rows, seq] micro-batch.
"""

from __future__ import annotations

import torch

from megapo import compat

compat.before_megatron()  # torch.compile's CPU stand-in, before this process's first Megatron import

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding  # noqa: E402
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding  # noqa: E402


class PositionIdsRotaryEmbedding(RotaryEmbedding):
    positions: torch.Tensor | None = None  # [rows, seq] position id of every token of the micro-batch
    longest: int = 0  # 1 + the largest position id (read on the host when the positions were set)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        if self.positions is None:
            return super().forward(max_seq_len, offset, packed_seq, cp_group)
        if self.positions.shape[-1] != max_seq_len:
            raise ValueError(f"position ids cover {self.positions.shape[-1]} tokens, the rows have {max_seq_len}")
        emb = self.get_emb(self.longest)[:, 0]  # [longest, 1, dim]
        return emb[self.positions.t()]  # [seq, rows, 1, dim]: broadcasts over the heads of [seq, rows, heads, dim]


class PositionIdsYarnRotaryEmbedding(YarnRotaryEmbedding):
    """The same for YaRN: its get_emb and forward also return the cos/sin scale, which attention reads from the
    config (GPTModel drops it)."""

    positions: torch.Tensor | None = None
    longest: int = 0

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        if self.positions is None:
            return super().forward(max_seq_len, offset, packed_seq, cp_group)
        if self.positions.shape[-1] != max_seq_len:
            raise ValueError(f"position ids cover {self.positions.shape[-1]} tokens, the rows have {max_seq_len}")
        emb, mscale = self.get_emb(self.longest)
        return emb[:, 0][self.positions.t()], mscale


def use_position_ids(model) -> None:
    """Make `model`'s rotary embeddings read position ids (class swap on our own model instance): the
    model's one, or with multi-latent attention each attention layer's own (listed on the model once, so
    that setting positions does not walk every module)."""
    swap = {RotaryEmbedding: PositionIdsRotaryEmbedding, YarnRotaryEmbedding: PositionIdsYarnRotaryEmbedding}
    ropes = [m for m in model.modules() if type(m) in swap]
    for rope in ropes:
        rope.__class__ = swap[type(rope)]
    model.position_id_ropes = ropes
    windowed = compat.window_core_attention()  # the local spec's sliding-window attention
    model.position_id_windows = [m for m in model.modules() if isinstance(m, windowed)]


def set_positions(model, position_ids: torch.Tensor | None, longest: int | None = None) -> None:
    """position_ids: [rows, seq] for the next forward (None: plain 0..seq-1); `longest`: 1 + their
    maximum when the caller knows it (saves a device-to-host read)."""
    while hasattr(model, "module"):
        model = model.module
    ropes = getattr(model, "position_id_ropes", ())
    if ropes and position_ids is not None and longest is None:
        longest = int(position_ids.max()) + 1
    for rope in ropes:
        rope.positions = position_ids
        rope.longest = longest or 0
    for attention in getattr(model, "position_id_windows", ()):  # sliding windows count positions, not slots
        attention.positions = position_ids
