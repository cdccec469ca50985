"""What the CPU kernel's backend keeps across the generate calls of one model: per machine, the forms its linear
layers multiply each row count in (timed apart, evident, or learnt from calls' own products by `cpu.FormTrials`),
the row counts still to learn, and the weight copies the forms compute from.

`FormBook` holds them beside the draft budget (`DraftBudget.kept`), in a file of its own in the user cache; the
budget's verify costs only record which forms they were timed under (`basis`), so that a change of forms drops them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from clover_hf import cpu
from clover_hf.core.hardware import available_memory
from clover_hf.core.user_cache import read_entry, write_entry

if TYPE_CHECKING:
    from clover_hf.decode.budget import DraftBudget
    from clover_hf.decode.costs import CostModel

FORMS_FILE = "linear_forms.v1.json"
COPY_SHARE = 0.5  # by default weight copies take at most this share of the memory available when they are made


def basis(forms: dict[int, str]) -> str:
    """How verify costs timed in `forms` are marked (`DraftBudget.rebase`)."""
    return json.dumps({str(n): form for n, form in sorted(forms.items())})


@dataclass
class MachineForms:
    """One machine's linear forms as stored: None until measured or learnt."""

    forms: dict[int, str] | None = None
    # the row counts whose forms are still to be learnt from the products of later calls; None: none
    pending: list[int] | None = None
    # milliseconds of a one-token forward in F.linear, as plain `generate` computes it, timed by the form trials:
    # how far ahead of plain a call is, which pays for learning the forms still pending
    plain_row_ms: float | None = None
    # each row count's fastest form without a weight copy, as the trials timed it: what its products take in a new
    # process while the copies its form computes from are still to be made
    fallbacks: dict[int, str] | None = None

    def verify_pending(self) -> bool:
        """Whether a verify forward's row count (up to PACK_ROWS) is still to be learnt; wider ones (a prefill's)
        are learnt by the prefills of later calls."""
        return any(n <= cpu.PACK_ROWS for n in self.pending or ())

    def plain_row_s(self, one_token_ms: float | None) -> float | None:
        """Seconds of plain `generate`'s one-token forward: as the trials timed it, else at least a one-token step's
        (`one_token_ms`, from the verify costs), over ONE_ROW_GAIN where one row took another form than F.linear
        (chosen only where it took at most that share of F.linear's time); None where neither is known."""
        if self.plain_row_ms is not None:
            return self.plain_row_ms / 1000
        if one_token_ms is None:
            return None
        return one_token_ms / 1000 / (cpu.ONE_ROW_GAIN if (self.forms or {}).get(1) else 1.0)

    def to_json(self) -> dict:
        data: dict = {}
        if self.forms is not None:
            data["forms"] = {str(n): f for n, f in sorted(self.forms.items())}
        if self.pending:
            data["pending"] = sorted(self.pending)
        if self.plain_row_ms is not None:
            data["plain_row_ms"] = round(self.plain_row_ms, 3)
        if self.fallbacks:
            data["fallbacks"] = {str(n): f for n, f in sorted(self.fallbacks.items())}
        return data

    @classmethod
    def from_json(cls, data: dict) -> MachineForms:
        forms, pending, plain_row = data.get("forms"), data.get("pending"), data.get("plain_row_ms")
        fallbacks = data.get("fallbacks")
        return cls(forms={int(n): str(f) for n, f in forms.items()} if isinstance(forms, dict) else None,
                   pending=[int(n) for n in pending] if isinstance(pending, list) else None,
                   plain_row_ms=float(plain_row) if isinstance(plain_row, (int, float)) else None,
                   fallbacks={int(n): str(f) for n, f in fallbacks.items()} if isinstance(fallbacks, dict) else None)


class FormBook:
    """The forms of each machine key, the trials learning them and the weight copies they compute from.

    `weight_copies`: the memory the forms may spend on copies of the base's weights made once (oneDNN's blocked
    layout; float16 or float32 copies of bf16 weights on CPUs without native bf16; the kernel's tiled copies). True:
    at most `COPY_SHARE` of the memory available when they are made; an int: at most that many bytes; False: none.
    `fixed`: the forms of a budget with fixed costs (nothing is measured; None: F.linear throughout)."""

    def __init__(self, weight_copies: bool | int = True, cache_dir: str | Path | None = None,
                 fixed: dict[int, str] | None = None) -> None:
        self.weight_copies, self.cache_dir, self.fixed = weight_copies, cache_dir, fixed
        self.copies = cpu.WeightCopies()
        self._machines: dict[str, MachineForms] = {}
        self._trials: dict[str, cpu.FormTrials] = {}  # forms being learnt from calls' products, per machine key
        self._provided: set[str] = set()  # machine keys whose forms' weight copies the trials made in `copies`

    @classmethod
    def of(cls, budget: DraftBudget) -> FormBook:
        """The book `budget` keeps for the kernel backend (made at first use, shared by the budget's views)."""
        return budget.kept("kernel forms", lambda: cls(budget.weight_copies, budget.cache_dir, budget.forms))

    def stored(self, key: str) -> MachineForms:
        """The forms kept for `key`: loaded from the user cache at first, then learnt in this process."""
        if key not in self._machines:
            entry = read_entry(FORMS_FILE, key, self.cache_dir)
            self._machines[key] = MachineForms.from_json(entry) if isinstance(entry, dict) else MachineForms()
        return self._machines[key]

    def save(self, key: str) -> None:
        write_entry(FORMS_FILE, key, self.stored(key).to_json(), self.cache_dir)

    def copy_limit(self) -> int:
        """Bytes weight copies may take now: those made already, plus what `weight_copies` allows."""
        if self.weight_copies is False:
            return 0
        if self.weight_copies is not True:
            return int(self.weight_copies)
        return self.copies.nbytes + int(COPY_SHARE * (available_memory() or 0))

    def use_copies(self, forms: dict[int, str], trials: cpu.FormTrials | None = None) -> cpu.WeightCopies | None:
        """The weight copies `forms` (and `trials`) compute from, bounded by `copy_limit` (freed when they use none)."""
        if cpu.copy_form(forms) is None and trials is None:
            self.copies.clear()
            self._provided.clear()
            return None
        self.copies.limit = self.copy_limit()
        return self.copies

    def forms(self, key: str, calibrate: bool | None, measure: Callable[[int], dict[int, str]]) -> dict[int, str]:
        """How linear layers compute each row count for `key`: stored, else measured by `measure(copy_limit)`
        (`cpu.faster_forms`; calibrate None: when not stored, or when the forms learnt from products still lack a
        verify forward's row count, as a batch's; True: again; False: never, which leaves F.linear throughout)."""
        stored = self.stored(key)
        unsettled = stored.forms is None or stored.verify_pending()
        if calibrate or (calibrate is None and unsettled):
            stored.forms, stored.pending, stored.plain_row_ms = dict(measure(self.copy_limit())), None, None
            self._trials.pop(key, None)
            self.save(key)
        return stored.forms or {}

    def form_trials(self, key: str, calibrate: bool | None, models: list[torch.nn.Module],
                    one_token_ms: float | None) -> cpu.FormTrials | None:
        """The forms for `key` learnt from this call's own products, where none are stored or some row counts are
        still pending, or the weight copies the stored forms compute from are still to be made in this process (the
        trials make them while the call is ahead of plain `generate`: made all at once, they can take a good share
        of a short call), and the call may measure (calibrate None); else None (the forms come from `forms`). CPU
        only. One `FormTrials` serves the calls of a process until every row count has settled and its copies are
        made; its forms are stored after each call (`keep_learnt`). Where the forms are evident
        (`cpu.evident_forms`), they are stored as they are and nothing is learnt. `one_token_ms`: a one-token verify
        step's stored cost (how far ahead of plain a call is, where the trials never timed plain's forward)."""
        if calibrate is not None:
            return None
        stored = self.stored(key)
        if stored.forms is not None and not stored.pending and (
                cpu.copy_form(stored.forms) is None or key in self._provided):
            return None
        if next(models[0].parameters()).device.type != "cpu":
            return None
        evident = cpu.evident_forms(models, self.copy_limit())
        if evident is not None:  # nothing to learn: the forms' copies are made as the call starts (`linear_forms`)
            if stored.forms != evident or stored.pending:
                stored.forms, stored.pending, stored.fallbacks = dict(evident), None, None
                self.save(key)
            self._trials.pop(key, None)
            self._provided.add(key)
            return None
        trials = self._trials.get(key)
        if trials is None or not trials.serves(models):
            self.copies.limit = self.copy_limit()
            known, fallbacks = stored.forms, stored.fallbacks or {}
            if known is not None and known.get(1) in cpu.COPIES and 1 not in fallbacks:
                # stored without the form one row takes until its copies are made (forms timed apart, or by an
                # earlier release): learnt again as on a first call; else one-row products would take F.linear, which
                # never gets a call ahead of plain, and so the copies would never be made
                known = None
            pending = None if known is None else set(stored.pending or ())
            trials = self._trials[key] = cpu.FormTrials(models, self.copies, known, pending,
                                                        stored.plain_row_s(one_token_ms), fallbacks)
        trials.next_call()
        return trials

    def keep_learnt(self, key: str, trials: cpu.FormTrials) -> None:
        """Store the forms `trials` learnt for `key`, the row counts still pending and plain's one-token forward;
        the trials end once `ready` (their copies made) with no row count pending (a prefill's may stay so for
        long: the products of others then pass them by)."""
        stored = self.stored(key)
        stored.forms, stored.pending = dict(trials.forms), sorted(trials.pending) or None
        stored.fallbacks = dict(trials.fallback) or None
        if trials.plain_row_s is not None:
            stored.plain_row_ms = 1000 * trials.plain_row_s
        if trials.ready():
            self._provided.add(key)
            if not trials.pending:
                self._trials.pop(key, None)
        self.save(key)

    def correct_inverted(self, key: str, costs: CostModel) -> list[int]:
        """Row counts whose form verified one row's tokens dearer (by `costs`) than a wider row count does in the copy
        form the forms keep (`cpu.copy_form`), switched to that form, their widths' costs dropped to be timed again.
        Such a form loses to the copy form at its own row count, which costs no more than at the wider one. The form
        trials time products one by one, and a form that wins a lone product can still lose in a whole verify
        forward, where the copy form's layout serves every layer. Returns the row counts switched; none while the
        trials are not ready or a verify forward's form is pending."""
        stored, trials = self.stored(key), self._trials.get(key)
        forms, kept, curve = stored.forms or {}, cpu.copy_form(stored.forms or {}), costs.ms.get(1)
        if kept is None or stored.verify_pending() or not curve or (trials is not None and not trials.ready()):
            return []
        switched = []
        for n, form in sorted(forms.items()):
            own = [ms for w, ms in curve.items() if cpu.row_bucket(w) == n]
            wider = [ms for w, ms in curve.items() if cpu.row_bucket(w) > n and cpu.form_for(forms, w) == kept]
            if form != kept and own and wider and min(own) > min(wider):
                forms[n] = kept
                if trials is not None:  # the forms calls use while a prefill's row count is still to learn
                    trials.forms[n] = kept
                switched.append(n)
        if switched:
            costs.forget([(rows, w) for rows, widths in costs.ms.items() for w in widths
                          if cpu.row_bucket(rows * w) in switched])
            self.save(key)
        return switched
