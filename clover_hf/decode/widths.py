"""The width of a step: how many tokens per row to verify (`choose_width`, the most expected tokens per
millisecond, from 1, a plain decoding step, to the whole tree) and which nodes a width keeps (`likeliest`,
`prune`).

The choice depends on draft probabilities, earlier steps and the clock, never on the target's outputs of the
step it is made for: greedy output stays identical and sampling stays lossless.
"""

from __future__ import annotations

from itertools import accumulate

from .costs import CostModel


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
    tokens: counting all rows' tokens chose widths that cost more per step than the tokens they added were worth,
    and the rows that ran ahead then waited for the last one. `explore`: weigh costs by `CostModel.price` (stale
    widths look cheaper) instead of the plain estimate; `most`: widths up to this only; `overhead_ms`: what the step
    costs besides its verify step, whatever the width (drafting): spread over more tokens, it makes wider widths
    pay, and leaving it out chose too narrow. `rate_floor`: tokens per ms
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
