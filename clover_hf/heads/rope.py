"""The rotary embedding of the Augmenting Block's layers: cos and sin computed for given positions
(`rope_tables`), or read from a table of every position up to the longest seen (`RotaryTable`), which spares
each drafting step the ops that compute them."""

from __future__ import annotations

import torch


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (B, 1, T, head_dim) of the rotary embedding at positions (B, T)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[:, None, :, None] * inv_freq  # (B, 1, T, hd/2)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], -1).to(dtype), torch.cat([sin, sin], -1).to(dtype)


class RotaryTable:
    """`rope_tables` of one head size and base. Without gradients on the CPU, cos and sin are read from a table of
    positions 0..P-1 per dtype (P a power of two, made again when a longer text needs more): bitwise the computed
    ones, as the table runs the same elementwise ops."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.head_dim, self.theta = head_dim, theta
        self.tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (B, 1, T, head_dim) at positions (B, T): a view of the table for one row of positions in
        order, else gathered from it; computed where the table does not serve."""
        if torch.is_grad_enabled() or positions.device.type != "cpu" or not positions.numel():
            return rope_tables(positions, self.head_dim, self.theta, dtype)
        rows = positions.tolist()
        cos, sin = self.table(max(max(row) for row in rows) + 1, dtype)
        start, count = rows[0][0], len(rows[0])
        if len(rows) == 1 and rows[0] == list(range(start, start + count)):
            return cos[None, None, start : start + count], sin[None, None, start : start + count]
        return cos[positions][:, None], sin[positions][:, None]

    def table(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (P, head_dim) of positions 0..P-1, P at least `length`."""
        table = self.tables.get(dtype)
        if table is None or table[0].shape[0] < length:
            table = self.tables[dtype] = self._new_table(length, dtype)
        return table

    @torch.inference_mode(False)  # kept past the call that makes them
    def _new_table(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        every = torch.arange(1 << max(length - 1, 1).bit_length())[None]
        cos, sin = rope_tables(every, self.head_dim, self.theta, dtype)
        return cos[0, 0], sin[0, 0]
