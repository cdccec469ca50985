"""The CPU kernel's backend: torch's eager forward with the base's and the heads' linear layers multiplying in the
forms this machine computes fastest (`clover_hf.cpu`: the kernel's tiled products, oneDNN's and fbgemm's packs,
weight copies), its decoder layers fused into kernel calls where the forms allow.

The forms are kept per machine beside the draft budget's costs (`kernel_forms.FormBook`). A first call on a machine
learns them from its own products (`cpu.FormTrials`): while it does, it verifies one token a step until it is far
enough ahead of plain decoding to afford trying wider ones, and binds the forms again once they settle. All of that
stays here: the decode loop only calls the step hooks.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from clover_hf import cpu
from clover_hf.base.verify_forward import VerifyForward

from .kernel_forms import FormBook, basis
from .keys import machine_key
from .torch_backend import TorchBackend

if TYPE_CHECKING:
    from clover_hf.decode.budget import DraftBudget
    from clover_hf.decode.choosing import StepBudget


class KernelBackend(TorchBackend):
    """`TorchBackend` with linear layers in the forms `forms` gives each row count (stored in the budget's `book`), or
    learnt by this call's `trials`, from the book's weight copies."""

    def __init__(self, model: PreTrainedModel, verify: VerifyForward, key: str | None, models: list[torch.nn.Module],
                 budget: DraftBudget, machine: str, forms: dict[int, str], trials: cpu.FormTrials | None) -> None:
        super().__init__(model, verify, key)
        self.models, self.budget, self.machine = models, budget, machine
        self.book = FormBook.of(budget)
        self.forms, self.trials = forms, trials
        self.copies = self.book.use_copies(forms, trials)
        self._forms_block: contextlib.ExitStack | None = None
        self._unsettled = 0  # the trials' count of unsettled products as the step's verify forward began

    @classmethod
    def create(cls, model: PreTrainedModel, models: list[torch.nn.Module], verify: VerifyForward,
               budget: DraftBudget | None, calibrate: bool | None, batch: int, static: bool) -> TorchBackend:
        """The backend for a call: the kernel's where the call multiplies in forms stored or being learnt, else
        torch's. With a budget, its costs are kept under the machine's key (`keys.machine_key`), and apart for a
        static cache (`static`) by how its forward runs. Batches time the forms apart rather than learning them
        inside their forwards (a batch's rows multiply several rows at once, where trying slow forms costs more); a
        compiled forward leaves its kernels to the compiler."""
        machine = None if budget is None else machine_key(model, budget.weight_copies)
        key = f"{machine}|static {verify.key}" if machine is not None and static else machine
        if budget is None or verify.compiled is not None:
            return TorchBackend(model, verify, key)
        book = FormBook.of(budget)
        if budget.fixed is not None:  # fixed costs: nothing learnt
            forms, trials = book.fixed or {}, None
        else:
            one_token = budget.stored(machine).ms.get(1, {}).get(1)
            trials = book.form_trials(machine, calibrate, models, one_token) if batch == 1 else None
            forms = trials.forms if trials is not None else book.forms(
                machine, calibrate, lambda limit: cpu.faster_forms(models, copy_limit=limit, copies=book.copies))
            for timed in {machine, key}:  # costs timed in other forms are dropped, but while the forms are learnt
                budget.rebase(timed, basis(forms), keep=trials is not None)
        if not forms and trials is None:
            return TorchBackend(model, verify, key)
        return cls(model, verify, key, models, budget, machine, forms, trials)

    def _packs(self) -> bool:
        return True  # attention packed where the call's products already round differently from plain decoding's

    @contextlib.contextmanager
    def bound(self) -> Iterator[None]:
        """The call's block: lean decoder layers (entered first: their check forward is not a product to time), then
        the linear forms, bound again once the trials settle (`after_step`)."""
        with super().bound(), contextlib.ExitStack() as forms_block:
            self._forms_block = forms_block
            forms_block.enter_context(self._bind())
            try:
                yield
            finally:
                self._forms_block = None

    def _bind(self):
        return cpu.linear_forms(self.models, self.forms, self.copies, self.trials)

    def prefill(self, *args, **kwargs):
        started = time.perf_counter()
        out = super().prefill(*args, **kwargs)
        if self.trials is not None:
            self.trials.prefilled(time.perf_counter() - started)
        return out

    def verify(self, ids: torch.Tensor, mask, positions: torch.Tensor, cache):
        if self.trials is not None:
            self._unsettled = self.trials.unsettled
        return super().verify(ids, mask, positions, cache)

    def argmax(self, scores: torch.Tensor) -> torch.Tensor:
        chosen = cpu.argmax(scores)
        return scores.argmax(-1) if chosen is None else chosen

    def forms_settled(self) -> bool:
        return self.trials is None or self.trials.ready()

    def learning(self) -> bool:
        return not self.forms_settled()

    def before_step(self, budget: StepBudget | None) -> None:
        """While the trials learn, a first call verifies one token a step until it can afford wider ones, and then the
        width the trials learn next."""
        if self.trials is not None and budget is not None:
            budget.cap = 1 if self.trials.one_token_steps() else None
            budget.learn(self.trials.width_to_learn())

    def after_step(self, budget: StepBudget | None, rows: int, width: int, started: float, emitted: int) -> None:
        """The budget learns the step's cost, provisional where its products still learnt forms (or lacked the copies
        they compute from); once the forms settle, the rest of the call runs in them, bound again (bound as the call
        began, the layers' products of the row counts it learnt still ran through the trials)."""
        if self.trials is None:
            return super().after_step(budget, rows, width, started, emitted)
        self.trials.emitted(emitted)
        if budget is None:
            return
        budget.verified(rows, width, started, self.settled, self.trials.unsettled != self._unsettled)
        if not budget.forms_settled and self.trials.ready():
            budget.forms_ready()
            self._forms_block.close()
            self._forms_block.enter_context(self._bind())

    def finish(self) -> None:
        """Store the forms the call learnt, with those its timed steps show slower than the copy form switched to it
        (`FormBook.correct_inverted`); the costs stay marked as timed in them (the forms only ever get faster)."""
        if self.budget.fixed is not None:
            return
        if self.trials is not None:
            self.book.keep_learnt(self.machine, self.trials)
        self.book.correct_inverted(self.machine, self.budget.stored(self.key))
        forms = self.book.stored(self.machine).forms
        if forms is not None:
            self.budget.rebase(self.key, basis(forms), keep=True)
