"""Training rows of a fixed length, packed from tokenized examples, for training with the base online.

Each row holds whole examples side by side; `position_ids` restart at 0 where an example starts, which
is how transformers recognises packed sequences (each attends only to itself) and how the heads' loss
keeps a target inside its own example. The free end of a row is padding with loss_mask 0.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


@dataclass
class Example:
    """A tokenized training sequence."""

    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token is one the heads should learn to draft (assistant text)


@dataclass
class PackedRows:
    """(R, L) token ids, loss mask and per-example positions; the examples' tokens per row."""

    input_ids: torch.Tensor  # (R, L) int32
    loss_mask: torch.Tensor  # (R, L) uint8
    position_ids: torch.Tensor  # (R, L) int32
    lengths: torch.Tensor  # (R,) int32: row r holds examples in [:lengths[r]], padding after

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def tokens(self) -> int:
        """Tokens of the examples (padding left out)."""
        return int(self.lengths.sum())

    @classmethod
    def pack(cls, examples: list[Example], length: int, pad_id: int) -> "PackedRows":
        """Best fit: each example (cut to `length`) goes into the open row it fills most tightly."""
        rows: list[list[Example]] = []
        free: list[tuple[int, int]] = []  # (space left, row index), sorted
        for ex in examples:
            n = min(len(ex.input_ids), length)
            k = bisect.bisect_left(free, (n, -1))
            if k == len(free):
                rows.append([])
                space, row = length, len(rows) - 1
            else:
                space, row = free.pop(k)
            rows[row].append(Example(ex.input_ids[:n], ex.loss_mask[:n]))
            if space - n > 0:
                bisect.insort(free, (space - n, row))
        ids = torch.full((len(rows), length), pad_id, dtype=torch.int32)
        mask = torch.zeros(len(rows), length, dtype=torch.uint8)
        positions = torch.zeros(len(rows), length, dtype=torch.int32)
        lengths = torch.zeros(len(rows), dtype=torch.int32)
        for r, members in enumerate(rows):
            at = 0
            for ex in members:
                n = len(ex.input_ids)
                ids[r, at : at + n] = torch.tensor(ex.input_ids, dtype=torch.int32)
                mask[r, at : at + n] = torch.tensor(ex.loss_mask, dtype=torch.uint8)
                positions[r, at : at + n] = torch.arange(n, dtype=torch.int32)
                at += n
            positions[r, at:] = torch.arange(length - at, dtype=torch.int32)  # padding: an example of its own
            lengths[r] = at
        return cls(ids, mask, positions, lengths)

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids[indices].long(),
            "loss_mask": self.loss_mask[indices].bool(),
            "position_ids": self.position_ids[indices].long(),
        }

    def count_tokens(self, indices: list[int]) -> int:
        """Tokens of these rows' examples (padding left out)."""
        return int(self.lengths[indices].sum())

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token is a training target (drives the draft vocabulary)."""
        return torch.bincount(self.input_ids[self.loss_mask.bool()].long(), minlength=vocab_size)

    def save(self, path: str | Path) -> None:
        """Written under a temporary name and renamed, so an interrupted write leaves no file."""
        path = Path(path)
        tmp = path.with_suffix(".tmp")
        save_file({"input_ids": self.input_ids, "loss_mask": self.loss_mask, "position_ids": self.position_ids,
                   "lengths": self.lengths}, str(tmp))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> "PackedRows":
        tensors = load_file(str(path))
        return cls(tensors["input_ids"], tensors["loss_mask"], tensors["position_ids"], tensors["lengths"])
