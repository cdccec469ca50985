"""What one `generate` call did (`GenerationStats`), and the wall time of its stages when profiling."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class GenerationStats:
    """What one `generate` call did. `steps` counts base forwards, the prefill included."""

    steps: int = 0
    new_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # drafted tokens accepted per verify step and row
    verified_tokens: int = 0  # tokens verified (root included) over all verify steps and rows
    head_drafts: int = 0  # verify steps whose tree the heads drafted (the others verified the lookup chain alone)
    # verify steps taken while the call still learnt how this machine multiplies (the linear forms, and the weight
    # copies they compute from: first calls on a machine, then kept in the user cache): until the call is far enough
    # ahead of plain decoding to afford that, such steps verify one token
    learning_steps: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)  # filled when profiling

    @property
    def tokens_per_step(self) -> float:
        """New tokens per base forward; the prefill forward counts as a step (it yields the first token)."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def verified_per_step(self) -> float:
        """Mean tokens verified per row and verify step: 1 is a plain decoding step."""
        return self.verified_tokens / len(self.accepted_lengths) if self.accepted_lengths else 0.0


class Clock:
    """Wall time per decode stage. Only when profiling: it syncs the device at every lap."""

    def __init__(self, totals: dict[str, float] | None, device: torch.device) -> None:
        self.totals, self.device = totals, device
        self.last = time.perf_counter()

    def lap(self, stage: str) -> None:
        if self.totals is None:
            return
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)
        now = time.perf_counter()
        self.totals[stage] = self.totals.get(stage, 0.0) + now - self.last
        self.last = now
