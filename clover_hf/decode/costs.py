"""The verify costs: milliseconds of one verify step by rows and tokens per row, on the machine at hand.

`CostModel` holds them: learnt from a call's first steps (or timed up front when asked), refined from every
step timed, and kept in the user cache (`load_costs`, `save_costs`) under the backend's key (`backends.cost_key`: what
they depend on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from clover_hf.base.verify_forward import bucket
from clover_hf.core.user_cache import read_entry, write_entry

WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128, 192, 256)
COSTS_FILE = "verify_costs.v8.json"  # v8: the linear forms kept apart (`backends.kernel_forms`)
OUTLIER = 2.0  # a timed step counts at most this many times the estimate
CALIBRATED = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192)  # widths timed up front (and the whole tree's);
# the steps refine them, and the choice is among those: a first call pays for few forwards
NARROW = 4  # widths up to this are calibrated twice, wider ones once (they cost more and are chosen less)
STALE_COST = 600  # a width is doubted most once the steps timed since it add up to this many times its own cost
MAX_DOUBT = 0.75  # when choosing, a width's cost counts down to (1 - this) of its estimate as it goes stale


@dataclass
class CostModel:
    """Predicted milliseconds of one verify step (forward, acceptance, cache upkeep) by rows and width."""

    ms: dict[int, dict[int, float]] = field(default_factory=dict)  # rows -> {tokens per row: ms}
    smoothing: float = 0.2  # weight of each timed step in the running estimate
    draft_ms: float | None = None  # drafting's cost per step when fixed; None: timed as decoding goes
    timed_ms: float = 0.0  # milliseconds of the steps timed (by this process)
    timed_at: dict[int, dict[int, float]] = field(default_factory=dict)  # rows -> {width: `timed_ms` when last timed}
    # what the backend computed these costs under (for the CPU kernel, its linear forms: `kernel_forms.basis`);
    # costs timed under another are dropped (`DraftBudget.rebase`). None: not said yet
    basis: str | None = None
    # the widths a compiled forward is padded to (`verify_forward.BUCKETS`): a width costs what its bucket
    # does, and only buckets are timed; None: every width is its own forward
    buckets: tuple[int, ...] | None = None
    # (rows, width) timed while the backend was still learning how to compute (`choosing.StepBudget.verified`): kept,
    # and stored, until timed again once it settled, in whichever call (or process) that happens
    provisional: set[tuple[int, int]] = field(default_factory=set)

    @classmethod
    def from_function(cls, fn: Callable[[int, int], float], rows: range | tuple = range(1, 9),
                      max_width: int = WIDTHS[-1], draft_ms: float | None = None) -> "CostModel":
        """A fixed model read off `fn(rows, width) -> ms` (for tests and what-if runs)."""
        return cls({r: {w: float(fn(r, w)) for w in WIDTHS if w <= max_width} for r in rows}, draft_ms=draft_ms)

    def covers(self, rows: int, width: int) -> bool:
        curve = self.ms.get(rows)
        return bool(curve) and 1 in curve and max(curve) >= width

    def curve(self, rows: int) -> dict[int, float]:
        """The widths' costs for `rows` rows; where those were never timed, the nearest row count's."""
        if rows not in self.ms:
            if not self.ms:
                raise ValueError("the cost model holds no costs yet")
            self.ms[rows] = dict(self.ms[min(self.ms, key=lambda r: (abs(r - rows), -r))])
        return self.ms[rows]

    def _bucket(self, width: int) -> int:
        return width if self.buckets is None else bucket(width, self.buckets)

    def predict(self, rows: int, width: int) -> float:
        """Linear between measured widths; past the widest, proportional to the width (a bucket's width
        costs what the bucket does)."""
        width = self._bucket(width)
        curve = self.curve(rows)
        if width in curve:
            return curve[width]
        below = [w for w in curve if w < width]
        above = [w for w in curve if w > width]
        if not above:
            return curve[max(below)] * width / max(below)
        if not below:
            return curve[min(above)]
        lo, hi = max(below), min(above)
        return curve[lo] + (curve[hi] - curve[lo]) * (width - lo) / (hi - lo)

    def widths(self, rows: int, limit: int) -> list[int]:
        """The widths to choose among: those measured below `limit`, and `limit` (the whole tree)."""
        return sorted({w for w in self.curve(rows) if w < limit and (self.buckets is None or w in self.buckets)}
                      | {limit})

    def staleness(self, rows: int, width: int, estimate: float | None = None) -> float:
        """From 0 (timed on the last step) to 1 (the steps timed since, or by this process, took
        `STALE_COST` times the width's own estimate: `predict`'s, or `estimate` where the caller has it)."""
        since = self.timed_ms - self.timed_at.get(rows, {}).get(self._bucket(width), 0.0)
        return min(since / (STALE_COST * (self.predict(rows, width) if estimate is None else estimate)), 1.0)

    def price(self, rows: int, width: int, estimate: float | None = None) -> float:
        """The cost to choose by: the estimate, less the longer the width went untimed.

        Only chosen widths are timed, so one that looks too dear (a stall was timed, or the machine
        sped up since) would never be chosen and corrected. Pricing it lower as it goes stale tries
        it again. A retry is chosen only once its doubt d outweighs how far it falls short of the
        best rate, so it wastes at most d times its cost, after the steps since took d / MAX_DOUBT *
        STALE_COST times its cost: each width's retries waste at most MAX_DOUBT / STALE_COST of the
        time (0.125%)."""
        estimate = self.predict(rows, width) if estimate is None else estimate
        return estimate * (1.0 - MAX_DOUBT * self.staleness(rows, width, estimate))

    def observe(self, rows: int, width: int, ms: float) -> None:
        """Fold one timed step into the estimate for its width. A step slower than twice the estimate
        counts as twice it: one stall of the machine must not make every wider step look cheap. A
        width untimed for long takes its new timing with more weight (its estimate is the doubtful one)."""
        curve = self.curve(rows) if self.ms else self.ms.setdefault(rows, {})
        if width not in curve:
            curve[width] = self.predict(rows, width) if curve else ms
        weight = max(self.smoothing, self.staleness(rows, width))
        curve[width] += weight * (min(ms, OUTLIER * curve[width]) - curve[width])
        self._timed(rows, width, ms)

    def record(self, rows: int, width: int, ms: float) -> None:
        """Take one timed step as the cost of a width not timed for `rows` rows before (a first call
        learns its costs from its own steps), at most OUTLIER times what the narrower widths timed predict
        (proportionally past the widest): one stalled step, several times its neighbours' cost, would
        otherwise price its width out of every later choice."""
        curve = self.ms.setdefault(rows, {})
        if any(w < width for w in curve):
            ms = min(ms, OUTLIER * self.predict(rows, width))
        curve[width] = ms
        self._timed(rows, width, ms)

    def doubt(self, timed: Iterable[tuple[int, int]]) -> None:
        """Doubt the costs of these (rows, width) most, as if untimed for long: they are priced lower and so
        soon timed again, that timing then replacing them (see `observe`)."""
        for rows, width in timed:
            if width in self.ms.get(rows, {}):
                self.timed_at.setdefault(rows, {})[self._bucket(width)] = (
                    self.timed_ms - STALE_COST * self.predict(rows, width))

    def _timed(self, rows: int, width: int, ms: float) -> None:
        self.timed_ms += ms
        self.timed_at.setdefault(rows, {})[width] = self.timed_ms

    def forget(self, timed: Iterable[tuple[int, int]]) -> None:
        """Drop the costs of these (rows, width), to be timed again (the backend changed how it computes them)."""
        for rows, width in timed:
            self.ms.get(rows, {}).pop(width, None)
            self.timed_at.get(rows, {}).pop(width, None)
            self.provisional.discard((rows, width))

    def calibrate(self, rows: int, limit: int, measure: Callable[[int], float]) -> None:
        """Time the CALIBRATED widths below `limit` (and `limit`) for `rows` rows now, with `measure(width) -> ms`."""
        widths = [w for w in CALIBRATED if w < limit] + [limit]
        curve = self.ms.setdefault(rows, {})
        measure(1)  # warm-up: the first forward of a process pays for one-off set-up
        for w in widths:
            curve[w] = measure(w)
        for w in widths:  # narrow widths once more, keeping the faster: one slow forward must not
            if w <= NARROW:  # rule out a width the budget may well choose
                curve[w] = min(curve[w], measure(w))

    def untimed(self, rows: int, limit: int) -> list[int]:
        """The calibrated widths (or buckets) up to `limit` (and `limit`) with no cost for `rows` rows yet,
        narrowest first."""
        timed = self.ms.get(rows, {})
        return [w for w in [*(w for w in self.buckets or CALIBRATED if w < limit), limit]
                if self._bucket(w) not in timed]

    def to_json(self) -> dict:
        data = {str(r): {str(w): round(ms, 3) for w, ms in sorted(c.items())} for r, c in self.ms.items()}
        if self.basis is not None:
            data["basis"] = self.basis
        if self.provisional:
            data["provisional"] = [list(pair) for pair in sorted(self.provisional)]
        return data

    @classmethod
    def from_json(cls, data: dict) -> "CostModel":
        curves = {int(r): {int(w): float(ms) for w, ms in c.items()} for r, c in data.items() if r.isdigit()}
        basis, provisional = data.get("basis"), data.get("provisional")
        pairs = provisional if isinstance(provisional, list) else []
        return cls(curves, basis=basis if isinstance(basis, str) else None,
                   provisional={(int(p[0]), int(p[1])) for p in pairs if isinstance(p, list) and len(p) == 2})


def load_costs(key: str, cache_dir: str | Path | None = None) -> CostModel | None:
    """The costs measured earlier under `key` (a JSON file in the user cache), or None."""
    entry = read_entry(COSTS_FILE, key, cache_dir)
    return CostModel.from_json(entry) if isinstance(entry, dict) else None


def save_costs(key: str, costs: CostModel, cache_dir: str | Path | None = None) -> None:
    """Store `costs` under `key`, replacing the file atomically (a crash never leaves half a file)."""
    write_entry(COSTS_FILE, key, costs.to_json(), cache_dir)
