"""The draft budget: each step, verify only the drafted nodes that pay on the machine at hand.

- `CostModel`: milliseconds of one verify step by rows and tokens per row, measured where the code
  runs (a calibration of a few forwards, kept in the user cache) and refined from the steps timed.
- `AcceptanceModel`: the chance that a drafted node is accepted once its parent is, from the heads'
  own probability (per depth) or the lookup chain's record (per n-gram length and chain depth),
  calibrated against what verification actually accepted.
- `choose_width`: the number of tokens per row to verify with the most expected tokens per
  millisecond, from 1 (a plain decoding step) to the whole tree. A width the budget stopped
  choosing is never timed again, so its estimate could stay wrong for good (a stall, or a machine
  that got faster): the longer a width goes untimed, the cheaper it is assumed to be when choosing,
  until it is tried once more; `HeadsGate` stops drafting with the
  heads while that does not pay for its own cost, and tries again after a pause.

The choice depends on draft probabilities, earlier steps and the clock, never on the target's
outputs of the step it is made for: greedy output stays identical and sampling stays lossless.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Callable, Hashable, Iterable

import torch

from clover_hf import cpu
from clover_hf.base.verify_forward import bucket
from clover_hf.core.hardware import available_memory, cpu_capability, cpu_name
from clover_hf.core.quantized import quantization
from clover_hf.core.user_cache import default_cache_dir
from clover_hf.cpu import (
    COPIES,
    ONE_ROW_GAIN,
    PACK_ROWS,
    FormTrials,
    WeightCopies,
    copy_form,
    evident_forms,
    form_for,
    row_bucket,
)

WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128, 192, 256)
COSTS_FILE = "verify_costs.v7.json"  # v7: oneDNN's blocked layout timed at one row too
COPY_SHARE = 0.5  # by default weight copies take at most this share of the memory available when they are made
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
    # how linear layers compute each row count (batch rows x tokens; `linears.faster_forms`), which the
    # costs were timed under; None: not measured yet
    forms: dict[int, str] | None = None
    # the row counts whose forms are still to be learnt from the products of later calls (`form_trials`);
    # None or empty: none (forms timed apart by `faster_forms`, or every row count settled)
    pending: list[int] | None = None
    # milliseconds of a one-token forward in F.linear, as plain `generate` computes it, timed by the form trials:
    # how far ahead of plain a call is, which pays for learning the forms still pending
    plain_row_ms: float | None = None
    # each row count's fastest form without a weight copy, as the form trials timed it: what its products take in
    # a new process while the copies its form computes from are still to be made; None: not timed
    fallbacks: dict[int, str] | None = None
    # the widths a compiled forward is padded to (`verify_forward.BUCKETS`): a width costs what its bucket
    # does, and only buckets are timed; None: every width is its own forward
    buckets: tuple[int, ...] | None = None
    # (rows, width) timed while the linear forms were still being learnt (`choosing.StepBudget.verified`): kept, and
    # stored, until timed again in settled forms, in whichever call (or process) that happens
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
        (proportionally past the widest): one stalled step (52 ms where its neighbours took 11, on the
        AVX-512-bf16 EPYC) had priced widths 4 and 8 out of a whole benchmark."""
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

    def correct_inverted_forms(self) -> list[int]:
        """Row counts whose form verified one row's tokens dearer than a wider row count does in the copy form the
        forms keep (`linears.copy_form`), switched to that form; their widths' costs are dropped, to be timed again.
        Such a form loses to the copy form at its own row count, which costs no more than at the wider one.
        The form trials time products one by one, and on the AVX-512-bf16 EPYC in float32 they settled 2 and 4
        rows on W @ x.T while verify forwards of 2-6 tokens took 28.9-40.9 ms against 28.4 for 8 in oneDNN's
        blocked layout; one bf16 run settled one row on ATen's kernel, 13.5 ms a token against 11.6 for two in the
        kernel's tiled copies. Returns the row counts switched; none while a verify forward's form is pending."""
        kept = copy_form(self.forms or {})
        curve = self.ms.get(1)
        if kept is None or self.verify_pending() or not curve:
            return []
        switched = []
        for n, form in sorted(self.forms.items()):
            own = [ms for w, ms in curve.items() if row_bucket(w) == n]
            wider = [ms for w, ms in curve.items() if row_bucket(w) > n and form_for(self.forms, w) == kept]
            if form != kept and own and wider and min(own) > min(wider):
                self.forms[n] = kept
                switched.append(n)
        for rows, widths in self.ms.items():
            for w in [w for w in widths if row_bucket(rows * w) in switched]:
                del widths[w]
                self.timed_at.get(rows, {}).pop(w, None)
                self.provisional.discard((rows, w))
        return switched

    def verify_pending(self) -> bool:
        """Whether a verify forward's row count (up to PACK_ROWS) is still to be learnt; wider ones (a prefill's)
        are learnt by the prefills of later calls."""
        return any(n <= PACK_ROWS for n in self.pending or ())

    def untimed(self, rows: int, limit: int) -> list[int]:
        """The calibrated widths (or buckets) up to `limit` (and `limit`) with no cost for `rows` rows yet,
        narrowest first."""
        timed = self.ms.get(rows, {})
        return [w for w in [*(w for w in self.buckets or CALIBRATED if w < limit), limit]
                if self._bucket(w) not in timed]

    def to_json(self) -> dict:
        data = {str(r): {str(w): round(ms, 3) for w, ms in sorted(c.items())} for r, c in self.ms.items()}
        if self.forms is not None:
            data["forms"] = {str(n): f for n, f in sorted(self.forms.items())}
        if self.pending:
            data["pending"] = sorted(self.pending)
        if self.plain_row_ms is not None:
            data["plain_row_ms"] = round(self.plain_row_ms, 3)
        if self.fallbacks:
            data["fallbacks"] = {str(n): f for n, f in sorted(self.fallbacks.items())}
        if self.provisional:
            data["provisional"] = [list(pair) for pair in sorted(self.provisional)]
        return data

    @classmethod
    def from_json(cls, data: dict) -> "CostModel":
        curves = {int(r): {int(w): float(ms) for w, ms in c.items()} for r, c in data.items() if r.isdigit()}
        forms, pending, plain_row = data.get("forms"), data.get("pending"), data.get("plain_row_ms")
        fallbacks, provisional = data.get("fallbacks"), data.get("provisional")
        pairs = provisional if isinstance(provisional, list) else []
        return cls(curves, forms={int(n): str(f) for n, f in forms.items()} if isinstance(forms, dict) else None,
                   pending=[int(n) for n in pending] if isinstance(pending, list) else None,
                   plain_row_ms=float(plain_row) if isinstance(plain_row, (int, float)) else None,
                   fallbacks={int(n): str(f) for n, f in fallbacks.items()} if isinstance(fallbacks, dict) else None,
                   provisional={(int(p[0]), int(p[1])) for p in pairs if isinstance(p, list) and len(p) == 2})


def _plain_row_s(costs: CostModel) -> float | None:
    """Seconds of plain `generate`'s one-token forward: as the form trials timed it, else (forms timed apart) at
    least a one-token step's, over ONE_ROW_GAIN where one row took another form than F.linear (chosen only
    where it took at most that share of F.linear's time); None where neither is known."""
    if costs.plain_row_ms is not None:
        return costs.plain_row_ms / 1000
    one_token = costs.ms.get(1, {}).get(1)
    if one_token is None:
        return None
    return one_token / 1000 / (ONE_ROW_GAIN if (costs.forms or {}).get(1) else 1.0)


def cost_key(model: torch.nn.Module, device: torch.device) -> str:
    """What a verify step's cost depends on: the base (its name, architecture and quantization), dtype,
    device, threads, CPU capability, torch version, and for bf16 on the CPU which `bf16_kernel` build computes (a
    changed kernel learns its costs and forms again)."""
    config = model.config.to_json_string(use_diff=False)
    arch = hashlib.sha1(config.encode()).hexdigest()[:12]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return "|".join([getattr(model.config, "_name_or_path", "") or "?", arch, str(model.dtype).removeprefix("torch."),
                     where, f"{torch.get_num_threads()} threads", cpu_name(), cpu_capability(),
                     f"torch {torch.__version__}"] + ([quantized] if (quantized := quantization(model)) else [])
                    + ([f"bf16 kernel {cpu.build_id()}"] if model.dtype == torch.bfloat16
                       and device.type == "cpu" and cpu.available() else []))


def _costs_path(cache_dir: str | Path | None) -> Path:
    return (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()) / COSTS_FILE


def load_costs(key: str, cache_dir: str | Path | None = None) -> CostModel | None:
    """The costs measured earlier under `key` (a JSON file in the user cache), or None."""
    try:
        data = json.loads(_costs_path(cache_dir).read_text())
    except (OSError, ValueError):
        return None
    entry = data.get(key) if isinstance(data, dict) else None
    return CostModel.from_json(entry) if isinstance(entry, dict) else None


def save_costs(key: str, costs: CostModel, cache_dir: str | Path | None = None) -> None:
    """Store `costs` under `key`, replacing the file atomically (a crash never leaves half a file)."""
    path = _costs_path(cache_dir)
    try:
        data = json.loads(path.read_text())
        data = data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        data = {}
    data[key] = costs.to_json()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".verify_costs.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


HEAD_BINS = 10  # the heads' probabilities are calibrated in this many equal bins per depth
PRIOR_WEIGHT = 2.0  # a bucket's prior counts as this many observed nodes
RECENT_DECAY = 0.98  # per verify step, the weight the text's earlier steps keep in its recent-acceptance factor
RECENT_PRIOR = 4.0  # the recent factor starts as if this many nodes had been accepted as expected
RECENT_RANGE = (0.25, 4.0)  # bounds of the recent factor
MAX_RATE = 0.99  # a scaled rate stays below 1: no drafted node is ever certain


class AcceptanceModel:
    """Chance that a drafted node is accepted given that its parent is, counted per bucket.

    A head node's bucket is its depth and its draft probability's bin; a lookup-chain node's is the
    length of the n-gram that found the chain and its depth in the chain. Each bucket starts from a
    prior (the bin's probability; for chains, more for longer n-grams) and learns from every node
    verified under an accepted parent.

    Texts differ: one copies its prompt for a while, another is new wording the heads rarely guess.
    So each source (heads, chain) also carries a recent factor, accepted / expected over the current
    text's last steps (decaying by `RECENT_DECAY` a step), that scales its buckets' rates;
    `start_text` resets it when a `generate` call begins.

    It counts on the host in plain Python: a step's tree has tens of nodes, and torch's overhead per
    operation on such small tensors made this bookkeeping a visible share of a plain decoding step.
    """

    def __init__(self, depth: int, chain: int, max_ngram: int = 3) -> None:
        self.depth, self.chain, self.max_ngram = depth, max(chain, 1), max_ngram
        head_prior = [(b + 0.5) / HEAD_BINS for b in range(HEAD_BINS)] * depth
        chain_prior = [0.05 + 0.15 * n for n in range(1, max_ngram + 1) for _ in range(self.chain)]
        self.prior = head_prior + chain_prior
        self.hits = [0.0] * len(self.prior)
        self.trials = [0.0] * len(self.prior)
        self.recent = [[0.0, 0.0], [0.0, 0.0]]  # (heads, chain) x (accepted, expected)

    def start_text(self) -> None:
        """Forget the recent factor: a new text begins."""
        self.recent = [[0.0, 0.0], [0.0, 0.0]]

    def recent_factors(self) -> tuple[float, float]:
        """Accepted / expected over recent steps, for the heads' nodes and the chain's."""
        low, high = RECENT_RANGE
        return tuple(min(max((a + RECENT_PRIOR) / (e + RECENT_PRIOR), low), high) for a, e in self.recent)

    def _base_rate(self, bucket: int) -> float:
        return (self.hits[bucket] + PRIOR_WEIGHT * self.prior[bucket]) / (self.trials[bucket] + PRIOR_WEIGHT)

    def _is_chain(self, bucket: int) -> bool:
        return bucket >= self.depth * HEAD_BINS

    def buckets(self, depths: list[int], probs: list[float], is_chain: list[bool], ngram: int) -> list[int]:
        """The bucket of each node of a drafted tree, from its depth, the heads' probability and whether
        it is the lookup chain's (found by an `ngram`-token match); -1 for the root."""
        chain_start = self.depth * HEAD_BINS + (min(max(ngram, 1), self.max_ngram) - 1) * self.chain
        out = []
        for depth, prob, chain in zip(depths, probs, is_chain):
            if depth == 0:
                out.append(-1)
            elif chain:
                out.append(chain_start + min(depth - 1, self.chain - 1))
            else:
                out.append((min(depth, self.depth) - 1) * HEAD_BINS + min(max(int(prob * HEAD_BINS), 0), HEAD_BINS - 1))
        return out

    def rates(self, buckets: list[int]) -> list[float]:
        """Each bucket's chance, scaled by its source's recent factor; -1 (the root) is certain."""
        factors = self.recent_factors()
        return [1.0 if b < 0 else min(self._base_rate(b) * factors[self._is_chain(b)], MAX_RATE) for b in buckets]

    def observe(self, buckets: list[int], parents: list[int], accepted: list[int]) -> None:
        """Count a verified tree's nodes whose parent was accepted, and which of them were: `buckets`
        and `parents` per node, `accepted` the accepted nodes' indices (root first)."""
        for source in self.recent:
            source[0] *= RECENT_DECAY
            source[1] *= RECENT_DECAY
        if len(buckets) == 1:  # a plain decoding step: nothing was tried
            return
        on_path = [False] * len(buckets)
        for node in accepted:
            on_path[node] = True
        tried = [node for node in range(1, len(buckets)) if buckets[node] >= 0 and on_path[parents[node]]]
        for node in tried:  # expected from the rates before this step's counts
            self.recent[self._is_chain(buckets[node])][1] += self._base_rate(buckets[node])
        for node in tried:
            self.trials[buckets[node]] += 1.0
            if on_path[node]:
                self.hits[buckets[node]] += 1.0
                self.recent[self._is_chain(buckets[node])][0] += 1.0


def path_chances(rates: list[float], parents: list[int]) -> list[float]:
    """Chance that each node's whole path is accepted: the product of its path's rates (nodes sorted
    by depth, so a parent comes first). Never more than its parent's, so the likeliest k nodes always
    form a tree."""
    chances = []
    for node, (rate, parent) in enumerate(zip(rates, parents)):
        chances.append(rate if node == 0 else chances[parent] * rate)
    return chances


def laggard_tokens(chances: list[list[float]], depths: list[list[int]], leads: list[int], widths: list[int]
                   ) -> dict[int, float]:
    """Per width: the expected tokens by which a step moves a batch's last row, the one furthest from its end.

    A call ends when its last row does, and a forward costs about the same with a row more or less, so
    tokens that take a row further ahead of the last one do not shorten the call. With the rows level
    (`leads` all 0) a step moves the last row by the fewest tokens any row accepts; a row `leads[b]`
    tokens ahead holds back only a step that would take the last row past it.
    chances[b], depths[b]: path chances and depths of row b's drafted nodes (root excluded); a width w
    keeps each row's w-1 likeliest nodes (`by_chance`, as `likeliest`). Siblings exclude each other, so the
    chance that row b accepts k tokens or more is the sum of its kept depth-k nodes' chances."""
    orders = [by_chance(c) for c in chances]
    deepest = max((max(d, default=0) for d in depths), default=0)
    reach = [[0.0] * (deepest + 1) for _ in chances]  # reach[b][k]: chance that row b accepts k or more drafts
    out, kept = {}, 0
    for width in sorted(widths):
        for b, order in enumerate(orders):
            for i in order[kept:width - 1]:
                reach[b][depths[b][i]] += chances[b][i]
        kept = max(kept, width - 1)
        tokens = 1.0
        for k in range(1, deepest + 1):  # chance that every row ends the step k tokens past the last row's start
            p = 1.0
            for b, lead in enumerate(leads):
                if k > lead:
                    p *= reach[b][k - lead]
            if p < 1e-4:  # deeper levels add less still
                break
            tokens += p
        out[width] = tokens
    return out


def choose_width(chances: list[list[float]], costs: CostModel, explore: bool = False, most: int | None = None,
                 overhead_ms: float = 0.0, rate_floor: float = 0.0, depths: list[list[int]] | None = None,
                 leads: list[int] | None = None) -> tuple[int, float, float]:
    """The tokens per row to verify, with the most expected tokens per millisecond of the whole step.

    chances[b]: path chances of row b's drafted nodes (root excluded). A width w verifies each row's root and its
    w-1 likeliest nodes. A batch given its rows' `depths` (of the nodes, as `chances`) and `leads` (tokens each row
    is ahead of the last one) counts the tokens the step moves its last row (`laggard_tokens`) instead of all rows'
    tokens: on the AVX-512-bf16 EPYC, batches of 4 spent 22% more per step to emit 13% more tokens, and the rows
    that ran ahead then waited for the last one. `explore`: weigh costs by `CostModel.price` (stale widths look
    cheaper) instead of the plain estimate; `most`: widths up to this only; `overhead_ms`: what the step costs
    besides its verify step, whatever the width (drafting): spread over more tokens, it makes wider widths pay (left
    out, on the AVX-512-bf16 EPYC, side by side over 12 prompts: 1.99 against 2.07 tokens a step, 2.35x against
    2.46x plain `generate`; the whole tree every step then ran 0.99x the budget). `rate_floor`: tokens per ms
    decoding gets without this step's overhead (the lookup chain alone): where the step's best rate falls short of
    it, each width's tokens are weighed against its verify cost at that rate instead (the overhead is sunk;
    spreading it must not verify tokens that cost more than they bring at the rate the other steps get). Returns
    (width, expected tokens of all rows, or of the last row's progress, predicted ms of the verify step).
    """
    rows = len(chances)
    limit = min(1 + max(len(c) for c in chances), most or float("inf"))
    widths = costs.widths(rows, limit)
    if rows > 1 and leads is not None:
        expected = laggard_tokens(chances, depths, leads, widths)
    else:
        gains = [[0.0, *accumulate(sorted(c, reverse=True))] for c in chances]
        expected = {width: sum(1 + g[min(width - 1, len(g) - 1)] for g in gains) for width in widths}
    options = []  # (width, tokens, ms, the cost it is weighed by)
    for width in widths:
        if options and expected[width] <= options[-1][1]:
            continue  # no more tokens than a narrower width: never worth its cost, however stale its estimate
        ms = costs.predict(rows, width)
        options.append((width, expected[width], ms, costs.price(rows, width, ms) if explore else ms))
    if not options:
        return 1, 0.0, 1.0
    width, tokens, ms, cost = max(options, key=lambda o: o[1] / (overhead_ms + o[3]))
    if tokens / (overhead_ms + cost) < rate_floor:
        width, tokens, ms, _ = max(options, key=lambda o: o[1] - rate_floor * o[3])
    return width, tokens, ms


def by_chance(chances: list[float]) -> list[int]:
    """Indices of the drafted nodes, likeliest first (stable: ties keep tree order, so parents come first)."""
    return sorted(range(len(chances)), key=lambda i: -chances[i])


def likeliest(chances: list[float], width: int) -> list[int]:
    """Node indices (root 0 first, then in tree order) of the root and the width-1 likeliest drafted nodes."""
    return [0, *sorted(i + 1 for i in by_chance(chances)[: width - 1])]


def prune(parents: list[int], depths: list[int], keep: list[int]) -> tuple[list[int], list[int]]:
    """Parents (renumbered) and depths of the nodes `keep` (sorted, root first, closed under parents)."""
    index = {node: i for i, node in enumerate(keep)}
    return [index[parents[node]] for node in keep], [depths[node] for node in keep]


MIN_PAUSE, MAX_PAUSE = 4, 256  # steps without the heads after drafting did not pay; doubles while it still does not
# drafting steps whose mean gain decides, at first and after each pause: judged by one step, a step where the lookup
# chain alone did well (its text copying earlier text) paused the heads, and the pauses doubled to MAX_PAUSE within
# a few calls on the AVX-512-bf16 EPYC, where the heads pay on average (34% of steps drafted in one run, 80% in others)
PROBE_STEPS = 4
# the heads pause only where their estimated rate falls this share below the lookup chain's alone: a pause costs what
# the estimate leaves out (the Augmenting Block catching up when drafting resumes, the judging steps). On the
# AVX-512-bf16 EPYC, bf16, side by side over MT-Bench prompts 1-20: pausing at any estimated loss 95.9 tokens/s (the
# heads drafting on 77% of steps), at 10% 99.6 (98%), at 20% 101.1; over 6 prompts of 1,200-1,800 tokens 44.0, 43.0,
# 43.4; at batch 4 the heads paused alike (drafting on 2% of steps)
PAUSE_MARGIN = 0.1
# a pause lasts long enough that the next judgement's drafting costs at most this share of the paused steps' time:
# a batch's rows draft one by one, and at 8 rows on the AVX-512-bf16 EPYC a drafting step took 18 ms against a
# 22 ms verify step, so pauses of 4, 8, 16... steps spent 6% of a call judging heads that never paid. (Counting
# the Augmenting Block's catching up on the prompt, the first steps of a process priced judgements so high that
# the heads drafted on 4 steps of 100 in its first three calls.)
PROBE_SHARE = 0.1
# Steps whose positions the Augmenting Block catches up on when the heads draft again after a pause: over all
# of a pause of hundreds of steps, each retry would cost a good share of what the pause saved. Its attention
# then skips the older positions (the prompt's too, when the pause began in an earlier call): drafts lose
# accuracy where the heads were not paying anyway, verification stays exact.
CATCH_UP_STEPS = 32
FULL_DEPTH_EVERY = 8  # of drafting steps, those that draft the tree's full depth whatever was used before


@dataclass
class HeadsGate:
    """Whether to draft with the heads this step: not while recent steps say drafting costs clearly
    more time than the tokens it adds are worth (PAUSE_MARGIN); after a pause (doubling while that
    holds, halving with each drafting step that pays) it tries again, judging afresh over PROBE_STEPS
    drafting steps.
    And how deep: one level below the deepest drafted node the last drafting step verified (each
    level costs a head pass), the tree's full depth now and then."""

    draft_ms: float | None = None  # running cost of drafting a tree
    augment_ms: float = 0.0  # running cost of the Augmenting Block per accepted position (paid only to draft)
    gain: float | None = None  # running (tokens/ms with the heads) / (tokens/ms with the lookup chain alone) - 1
    pause: int = 0
    next_pause: int = MIN_PAUSE
    # weight of each drafting step in the running figures: a gain estimated step by step is noisy, and at 0.3 its
    # running mean dipped below zero often enough that the heads drafted on 56-77% of steps where drafting on
    # every one ran 2-8% faster (AVX-512-bf16 EPYC, bf16, prompts 1-40); at 0.1 they drafted on 91-92% and ran
    # 1.03-1.08x the faster
    smoothing: float = 0.1
    depth: int | None = None  # drafting depth; None: the tree's own
    drafted: int = 0
    probe: list[float] = field(default_factory=list)  # gains of the drafting steps since it began judging afresh
    unsettled: bool = False  # judged on steps whose linear forms were still being learnt (`restart` once settled)

    def restart(self) -> None:
        """Forget what was judged while the linear forms were being learnt: their steps (and drafting) cost more
        than they will. On the AVX-512-bf16 EPYC a process's first call doubled the pauses to 74 steps that way,
        and its second call drafted on 11 of 112 steps (1.14 tokens a step, against 1.78-1.97 in the next calls)."""
        self.draft_ms, self.augment_ms, self.gain, self.probe = None, 0.0, None, []
        self.pause, self.next_pause, self.depth, self.unsettled = 0, MIN_PAUSE, None, False

    def drafting(self) -> bool:
        if self.pause > 0:
            self.pause -= 1
            return False
        return True

    def draft_depth(self, full: int) -> int:
        """How deep to draft this step, for a tree `full` levels deep."""
        self.drafted += 1
        if self.depth is None or self.drafted % FULL_DEPTH_EVERY == 0:
            return full
        return min(self.depth, full)

    def used(self, deepest: int) -> None:
        """The deepest drafted node a drafting step verified (0: none)."""
        self.depth = deepest + 1

    def drafting_ms(self, draft_ms: float, augment_ms: float) -> float:
        """What drafting a tree costs a step: the running cost, else this step's (`draft_ms`, and the Augmenting
        Block's `augment_ms` per position, for the one position a step accepts at the least)."""
        if self.draft_ms is None:
            return draft_ms + augment_ms
        return self.draft_ms + self.augment_ms

    def record(self, draft_ms: float, augment_ms: float, tokens: float, verify_ms: float, rate_without: float) -> None:
        """One drafted step: its drafting time and the Augmenting Block's per position, and the
        expected tokens and predicted ms of the chosen width, against the best expected rate of the
        lookup chain alone."""
        if self.draft_ms is None:
            self.draft_ms, self.augment_ms = draft_ms, augment_ms
        else:
            self.draft_ms += self.smoothing * (draft_ms - self.draft_ms)
            self.augment_ms += self.smoothing * (augment_ms - self.augment_ms)
        rate = tokens / (verify_ms + self.draft_ms + self.augment_ms * tokens)
        gain = rate / rate_without - 1 if rate_without > 0 else 1.0
        if self.gain is None:  # judged afresh: one step whose lookup chain alone did well must not decide
            self.probe.append(gain)
            if len(self.probe) < PROBE_STEPS:
                return
            self.gain, self.probe = sum(self.probe) / len(self.probe), []
        else:
            self.gain += self.smoothing * (gain - self.gain)
        if self.gain < -PAUSE_MARGIN:
            judging = math.ceil(PROBE_STEPS * (self.draft_ms + self.augment_ms) / (PROBE_SHARE * verify_ms))
            self.pause = min(max(self.next_pause, judging), MAX_PAUSE)
            self.next_pause = min(2 * self.pause, MAX_PAUSE)
            self.gain = None  # judged afresh after the pause
        else:  # halved, not reset: one lucky retry where the heads hardly ever pay must not bring back frequent ones
            self.next_pause = max(self.next_pause // 2, MIN_PAUSE)


class DraftBudget:
    """What the per-step choice keeps across `generate` calls of one model: verify costs per machine
    (loaded from and saved to the user cache) and acceptance per decoding mode.

    `costs` fixes the cost model (nothing is measured, refined or saved: with its `draft_ms` set,
    the choices are the same on every run); `cache_dir` overrides where costs are kept (default:
    `$CLOVER_HF_CACHE` or ~/.cache/clover_hf).

    `weight_copies`: the memory the linear forms may spend on copies of the base's weights made once
    (oneDNN's blocked layout; float16 or float32 copies of bf16 weights on CPUs without native bf16;
    see linears.py). True: at most `COPY_SHARE` of the memory available when they are made; an int: at
    most that many bytes; False: none. `widest`: verify at most this many tokens per row each step (1:
    plain decoding steps in Clover's kernels, no drafting: what speculation adds is measured against it).
    """

    def __init__(self, costs: CostModel | None = None, cache_dir: str | Path | None = None,
                 weight_copies: bool | int = True, widest: int | None = None) -> None:
        if isinstance(weight_copies, int) and not isinstance(weight_copies, bool) and weight_copies < 0:
            raise ValueError(f"weight_copies must be True, False or a number of bytes >= 0, got {weight_copies}")
        if widest is not None and widest < 1:
            raise ValueError(f"widest must be at least 1 (a plain decoding step), got {widest}")
        self.fixed = costs
        self.cache_dir = cache_dir
        self.weight_copies = weight_copies
        self.widest = widest
        self.cut = True  # False: the whole tree every step, in this budget's linear forms (`whole_tree`)
        self.copies = WeightCopies()
        self._costs: dict[str, CostModel] = {}
        self._acceptance: dict[tuple, AcceptanceModel] = {}
        self._trials: dict[str, FormTrials] = {}  # forms being learnt from calls' products, per machine key
        self._provided: set[str] = set()  # machine keys whose forms' weight copies the trials made in `copies`
        self._gates: dict[int, HeadsGate] = {}

    @property
    def gate(self) -> HeadsGate:
        """The heads gate of one-row calls (`gate_for`)."""
        return self.gate_for(1)

    def gate_for(self, rows: int, setting: Hashable | None = None) -> HeadsGate:
        """The heads gate of calls that start with `rows` rows and draft with `setting` (the caller's tree and
        chain; None: the heads' own). Whether drafting pays differs with the batch (a batch's rows draft one by
        one, and its steps count the tokens of its last row): on the AVX-512-bf16 EPYC the heads paid at one row
        and never at 4 or 8, where pauses grew to 256 steps, which a shared gate would have carried into the next
        one-row call. And with the tree: calls alternating three trees on one gate drafted on 27-40% of steps,
        where the heads' own tree alone drafted on 78%."""
        return self._gates.setdefault((rows, setting), HeadsGate())

    def one_token(self) -> "DraftBudget":
        """This budget verifying one token a step: the same costs, forms and weight copies (shared, not copied)."""
        return self._view(widest=1)

    def _view(self, **changes) -> "DraftBudget":
        view = copy.copy(self)  # shallow: the costs, acceptance, gates and weight copies stay this budget's
        view.__dict__.update(changes)
        return view

    def whole_tree(self) -> "DraftBudget":
        """This budget verifying the whole tree every step, in its linear forms and weight copies (shared)."""
        return self._view(cut=False)

    def copy_limit(self) -> int:
        """Bytes weight copies may take now: those made already, plus what `weight_copies` allows."""
        if self.weight_copies is False:
            return 0
        if self.weight_copies is not True:
            return int(self.weight_copies)
        return self.copies.nbytes + int(COPY_SHARE * (available_memory() or 0))

    def key_suffix(self) -> str:
        """What the forms (and so the costs) depend on beyond the machine: whether weight copies are allowed."""
        return "weight copies" if self.weight_copies is not False else "no weight copies"

    def use_copies(self, forms: dict[int, str], trials: FormTrials | None = None) -> WeightCopies | None:
        """The weight copies `forms` (and `trials`) compute from, bounded by `copy_limit` (freed when they use none)."""
        if copy_form(forms) is None and trials is None:
            self.copies.clear()
            self._provided.clear()
            return None
        self.copies.limit = self.copy_limit()
        return self.copies

    def acceptance(self, sample: bool, depth: int, chain: int) -> AcceptanceModel:
        key = (sample, depth, chain)
        if key not in self._acceptance:
            self._acceptance[key] = AcceptanceModel(depth, chain)
        return self._acceptance[key]

    def stored(self, key: str) -> CostModel:
        """The costs kept for `key`: loaded from the user cache at first, then learnt in this process."""
        if key not in self._costs:
            self._costs[key] = load_costs(key, self.cache_dir) or CostModel()
        return self._costs[key]

    def forms(self, key: str, calibrate: bool | None, measure: Callable[[int], dict[int, str]]) -> dict[int, str]:
        """How linear layers compute each row count for `key` (`linears.faster_forms`): stored, else
        measured by `measure(copy_limit)` (calibrate None: when not stored, or when the forms learnt from
        products (`form_trials`) still lack a verify forward's row count, as a batch's; True: again; False:
        never, which leaves F.linear throughout). Costs timed under other forms, or before forms were
        chosen, are dropped. A fixed cost model uses its own (none unless set)."""
        if self.fixed is not None:
            return self.fixed.forms or {}
        costs = self.stored(key)
        unsettled = costs.forms is None or costs.verify_pending()
        if calibrate or (calibrate is None and unsettled):
            self.share_forms(key, measure(self.copy_limit()))
            costs.pending, costs.plain_row_ms = None, None
            self._trials.pop(key, None)
            save_costs(key, costs, self.cache_dir)
        return costs.forms or {}

    def form_trials(self, key: str, calibrate: bool | None, models: list[torch.nn.Module]) -> FormTrials | None:
        """The forms for `key` learnt from this call's own products (`form_trials`), where none are stored
        or some row counts are still pending, or the weight copies the stored forms compute from are still to
        be made in this process (the trials make them while the call is ahead of plain `generate`: made all at
        once, SmolLM2's took 110 ms, half a short call), and the call may measure (calibrate None); else None
        (the forms come from `forms`). CPU only. One `FormTrials` serves the calls of a process until every
        row count has settled and its copies are made; its forms are stored after each call (`keep_learnt`).
        Where the forms are evident (`linears.evident_forms`), they are stored as they are and nothing is learnt."""
        if self.fixed is not None or calibrate is not None:
            return None
        costs = self.stored(key)
        if costs.forms is not None and not costs.pending and (copy_form(costs.forms) is None or key in self._provided):
            return None
        if next(models[0].parameters()).device.type != "cpu":
            return None
        evident = evident_forms(models, self.copy_limit())
        if evident is not None:  # nothing to learn: the forms' copies are made as the call starts (`linear_forms`)
            if costs.forms != evident or costs.pending:
                self.share_forms(key, evident)
                costs.pending, costs.fallbacks = None, None
                save_costs(key, costs, self.cache_dir)
            self._trials.pop(key, None)
            self._provided.add(key)
            return None
        trials = self._trials.get(key)
        if trials is None or not trials.serves(models):
            self.copies.limit = self.copy_limit()
            known, fallbacks = costs.forms, costs.fallbacks or {}
            if known is not None and known.get(1) in COPIES and 1 not in fallbacks:
                # stored without the form one row takes until its copies are made (forms timed apart, or by an
                # earlier release): learnt again as on a first call; else one-row products would take F.linear, which
                # never gets a call ahead of plain, and so the copies would never be made
                known = None
            pending = None if known is None else set(costs.pending or ())
            trials = self._trials[key] = FormTrials(models, self.copies, known, pending, _plain_row_s(costs), fallbacks)
        trials.next_call()
        return trials

    def keep_learnt(self, key: str, trials: FormTrials) -> None:
        """Store the forms `trials` learnt for `key`, the row counts still pending and plain's one-token forward;
        the trials end once `ready` (their copies made) with no row count pending (a prefill's may stay so for
        long: the products of others then pass them by). Trials only ever settle on forms faster than those the
        verify costs were timed under: the costs stay, and the steps that time them bring them down (dropping them
        would time every width again)."""
        if self.fixed is None:
            costs = self.stored(key)
            costs.forms, costs.pending = dict(trials.forms), sorted(trials.pending) or None
            costs.fallbacks = dict(trials.fallback) or None
            if trials.plain_row_s is not None:
                costs.plain_row_ms = 1000 * trials.plain_row_s
            if trials.ready():
                self._provided.add(key)
                if not trials.pending:
                    self._trials.pop(key, None)

    def share_forms(self, key: str, forms: dict[int, str], learning: bool = False) -> None:
        """Costs under `key` are timed in `forms` (measured for it, or under another key: another cache on the
        same machine); curves timed under other forms no longer hold, and are dropped, but while the forms
        are `learning` from trials (which only settle on faster ones: see `keep_learnt`)."""
        if self.fixed is not None:
            return
        costs = self.stored(key)
        if costs.forms != forms:
            if not learning:
                costs.ms, costs.timed_at = {}, {}
            costs.forms = dict(forms)

    def costs(self, key: str, rows: int, limit: int, measure: Callable[[int], float], calibrate: bool | None
              ) -> CostModel | None:
        """The cost model for `key` for `rows` rows up to width `limit`, or None where it has none.

        calibrate None: what is not known yet (`CostModel.untimed`) is learnt from the call's first
        steps, each verifying one such width (no forward is spent on timing alone, so a first call
        costs little more than later ones); True: time every width again now, with `measure(width) ->
        ms`, one verify forward in the linear forms `forms()` chose (which comes first); False: never
        (without stored costs, None).
        """
        if self.fixed is not None:
            if not self.fixed.ms:
                raise ValueError("the cost model given as budget holds no costs: build it with CostModel.from_function")
            return self.fixed
        costs = self.stored(key)
        if calibrate is None:
            return costs
        if calibrate:
            widths = [w for w in CALIBRATED if w < limit] + [limit]
            curve = costs.ms.setdefault(rows, {})
            measure(1)  # warm-up: the first forward of a process pays for one-off set-up
            for w in widths:
                curve[w] = measure(w)
            for w in widths:  # narrow widths once more, keeping the faster: one slow forward must not
                if w <= NARROW:  # rule out a width the budget may well choose
                    curve[w] = min(curve[w], measure(w))
            save_costs(key, costs, self.cache_dir)
        return costs if costs.covers(rows, 1) else None

    def save(self, key: str) -> None:
        """Keep what the timed steps refined for the next process, with forms their costs show slower than the copy
        form switched to it (`CostModel.correct_inverted_forms`) once the trials' forms are ready."""
        if self.fixed is None and key in self._costs:
            trials = self._trials.get(key)
            if trials is None or trials.ready():
                costs = self._costs[key]
                for n in costs.correct_inverted_forms():
                    if trials is not None:  # the forms calls use while a prefill's row count is still to learn
                        trials.forms[n] = costs.forms[n]
            save_costs(key, self._costs[key], self.cache_dir)
