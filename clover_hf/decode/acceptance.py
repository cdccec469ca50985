"""The acceptance model: the chance that a drafted node is accepted once its parent is, from the heads' own
probability (per depth) or the lookup chain's record (per n-gram length and chain depth), calibrated against
what verification actually accepted; and the chance of each node's whole path (`path_chances`).
"""

from __future__ import annotations

HEAD_BINS = 10  # the heads' probabilities are calibrated in this many equal bins per depth
PRIOR_WEIGHT = 2.0  # a bucket's prior counts as this many observed nodes
MAX_RATE = 0.99  # a rate stays below 1: no drafted node is ever certain


class AcceptanceModel:
    """Chance that a drafted node is accepted given that its parent is, counted per bucket.

    A head node's bucket is its depth and its draft probability's bin; a lookup-chain node's is the
    length of the n-gram that found the chain and its depth in the chain. Each bucket starts from a
    prior (the bin's probability; for chains, more for longer n-grams) and learns from every node
    verified under an accepted parent.

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

    def _base_rate(self, bucket: int) -> float:
        return (self.hits[bucket] + PRIOR_WEIGHT * self.prior[bucket]) / (self.trials[bucket] + PRIOR_WEIGHT)

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
        """Each bucket's chance; -1 (the root) is certain."""
        return [1.0 if b < 0 else min(self._base_rate(b), MAX_RATE) for b in buckets]

    def observe(self, buckets: list[int], parents: list[int], accepted: list[int]) -> None:
        """Count a verified tree's nodes whose parent was accepted, and which of them were: `buckets`
        and `parents` per node, `accepted` the accepted nodes' indices (root first)."""
        if len(buckets) == 1:  # a plain decoding step: nothing was tried
            return
        on_path = [False] * len(buckets)
        for node in accepted:
            on_path[node] = True
        tried = [node for node in range(1, len(buckets)) if buckets[node] >= 0 and on_path[parents[node]]]
        for node in tried:
            self.trials[buckets[node]] += 1.0
            if on_path[node]:
                self.hits[buckets[node]] += 1.0


def path_chances(rates: list[float], parents: list[int]) -> list[float]:
    """Chance that each node's whole path is accepted: the product of its path's rates (nodes sorted
    by depth, so a parent comes first). Never more than its parent's, so the likeliest k nodes always
    form a tree."""
    chances = []
    for node, (rate, parent) in enumerate(zip(rates, parents)):
        chances.append(rate if node == 0 else chances[parent] * rate)
    return chances
