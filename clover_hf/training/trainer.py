"""Training draft heads (Clover's, or the Medusa baseline's) on a frozen base: one Accelerate loop on
CPU, one GPU, or many processes.

Per head i the loss is cross-entropy against the base's own next-token distribution at the target
position (soft labels: its top-k, or the whole distribution, restricted to the draft vocabulary) plus a
SmoothL1 pull of the head's output features toward the base's hidden state there, weighted
head_decay ** i (Clover-2 recipe); or, for Medusa-1, cross-entropy on the data's own next tokens.
The base's outputs come from cached features (`FeatureSet`) or from the base itself, run inside the
training step over packed rows (`PackedRows`), so the data can grow without disk.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from tqdm.auto import tqdm

from clover_hf.heads.config import check_head_type
from clover_hf.heads.base import DraftHeads, document_ids
from clover_hf.heads.lm_head import DraftLMHead

from .features import FeatureSet, base_targets, inputs_read
from .packing import PackedRows

RANKS = 10  # evaluation records where the base's top-1 falls among each head's top-10 (shapes the tree)
LABELS = ("top_k", "full", "data")
SCHEDULES = ("linear", "cosine")
STOPPED_EXIT_CODE = 75  # EX_TEMPFAIL: `clover-hf train` stopped at --max-minutes with a checkpoint; run it again
TIMED_STEPS = (2, 8)  # with train_minutes, a run's length comes from the time of its steps 3 to 8 (after warm-up)


@dataclass
class TrainConfig:
    output_dir: str = field(metadata={"help": "Where checkpoints, caches and the final heads go."})
    num_heads: int = field(default=4, metadata={"help": "Draft depth."})
    num_augment_layers: int = field(default=1, metadata={"help": "Decoder layers in the Augmenting Block."})
    head_type: str = field(default="clover", metadata={"help": "clover, or medusa (the Medusa-1 baseline heads)."})
    output_head: str = field(
        default="residual", metadata={"help": "Clover's output heads: residual, or linear (Clover-2's public code)."}
    )
    init_norms_from_base: bool = field(
        default=False, metadata={"help": "Start the Augmenting Block's final norm from the base's final norm (Clover-2)."}
    )
    head_input: str = field(
        default="post_norm", metadata={"help": "The base's states the heads read: post_norm, or pre_norm (Clover-2; "
                                               "cached with the features, or --online)."}
    )
    decoder_bias: bool = field(default=False, metadata={"help": "Biases on the Attention Decoders' q, k, v (Clover-2)."})
    embed_from_lm_head: bool = field(
        default=False, metadata={"help": "Embed drafted tokens with the lm_head's rows (Clover-2)."}
    )
    medusa_num_layers: int = field(default=1, metadata={"help": "Medusa: residual blocks per head."})
    own_lm_heads: bool = field(
        default=False, metadata={"help": "Medusa: a vocabulary projection per head, from the base's lm_head (Medusa-1)."}
    )
    labels: str = field(
        default="top_k", metadata={"help": "What each head learns to predict: top_k, the base's k likeliest next tokens "
                                           "(soft labels, Clover); full, the base's whole distribution (soft labels, "
                                           "Clover-2; needs --online); data, the data's own next token (Medusa-1)."}
    )
    label_top_k: int | None = field(
        default=None, metadata={"help": "Soft labels from the base's top-k tokens, renormalised (1: its top-1 alone, "
                                        "as cross-entropy on hard labels; None: all the k cached)."}
    )
    label_mask: int | None = field(
        default=None, metadata={"help": "Train head i at a position only where each token it reads after the base's "
                                        "state was among the base's N likeliest there (1: the contexts greedy "
                                        "decoding reaches). GRIFFIN's loss mask (arXiv 2502.11018), Clover-2's "
                                        "label_mask. None: every position."}
    )
    feature_layers: list[int] | None = field(
        default=None, metadata={"help": "Clover: the heads also read these decoder layers' outputs, fused with the "
                                        "last hidden state (EAGLE-3, arXiv 2503.01840), e.g. 2 15; cached with "
                                        "the features, or --online."}
    )
    draft_vocab_size: int | None = field(default=8192, metadata={"help": "Frequent tokens to draft from (None: all)."})
    max_steps: int = field(default=1000, metadata={"help": "Optimizer steps (unless --epochs)."})
    epochs: float | None = field(
        default=None, metadata={"help": "Passes over the training sequences; sets the number of steps instead of --max-steps."}
    )
    train_minutes: float | None = field(
        default=None, metadata={"help": "Fit the whole run into about this much training time: the speed of the first "
                                        "steps cuts the number of steps (and the schedule follows)."}
    )
    max_minutes: float | None = field(
        default=None, metadata={"help": f"Stop after this long with a checkpoint, exit code {STOPPED_EXIT_CODE}; "
                                        "the same command continues from it."}
    )
    batch_size: int = field(default=8, metadata={"help": "Sequences per optimizer step, over all processes."})
    lr: float = field(default=1e-3, metadata={"help": "Peak AdamW learning rate."})
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_steps: int = field(default=50, metadata={"help": "Linear warmup, then decay to 0 (--schedule)."})
    schedule: str = field(default="linear", metadata={"help": "Decay after warmup: linear (Clover-2) or cosine (Medusa-1)."})
    grad_clip: float = 1.0
    head_decay: float = field(default=0.7, metadata={"help": "Loss weight of head i is head_decay ** i."})
    feature_loss_weight: float = field(default=1.0, metadata={"help": "Weight of the SmoothL1 feature loss."})
    eval_fraction: float = field(default=0.05, metadata={"help": "Share of sequences held out for evaluation."})
    eval_every: int = 200
    save_every: int = 100
    tree_size: int | None = field(
        default=24, metadata={"help": "Draft-tree nodes, shaped from measured acceptance (None: default tree)."}
    )
    init_heads: str | None = field(
        default=None, metadata={"help": "Start from these heads (directory or repo id) instead of fresh ones."}
    )
    seed: int = 0
    eval_seed: int | None = field(
        default=None, metadata={"help": "The seed that picks the held-out sequences (default: --seed); runs with other "
                                        "seeds and this one evaluate on the same sequences."}
    )
    mixed_precision: str = field(default="no", metadata={"help": "Accelerate mixed precision: no, bf16, fp16."})

    def __post_init__(self) -> None:
        if self.max_steps < 1 or self.batch_size < 1:
            raise ValueError("max_steps and batch_size must be >= 1")
        check_head_type(self.head_type)  # here too, so a bad value fails before features are cached
        if self.labels not in LABELS:
            raise ValueError(f"labels must be one of {LABELS}, got {self.labels!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.train_minutes is not None and self.train_minutes <= 0:
            raise ValueError(f"train_minutes must be > 0, got {self.train_minutes}")
        if self.epochs is not None and self.epochs <= 0:
            raise ValueError(f"epochs must be > 0, got {self.epochs}")
        if self.label_mask is not None and self.label_mask < 1:
            raise ValueError(f"label_mask must be >= 1 (or None: no mask), got {self.label_mask}")
        if self.label_top_k is not None and self.label_top_k < 1:
            raise ValueError(f"label_top_k must be >= 1 (or None: every cached token), got {self.label_top_k}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
        self.betas = tuple(self.betas)


def lr_lambda(step: int, warmup: int, total: int, schedule: str = "linear") -> float:
    """Learning-rate factor at `step`: linear warmup, then linear or cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    left = max(0.0, (total - step) / max(1, total - warmup))
    return left if schedule == "linear" else 0.5 * (1 - math.cos(math.pi * left))


def choose_draft_vocab(counts: torch.Tensor, size: int | None) -> torch.Tensor | None:
    """The `size` most frequent target tokens, sorted by id."""
    if size is None or size >= counts.numel():
        return None
    return counts.topk(size).indices.sort().values


def reached(x: torch.Tensor, topk_ids: torch.Tensor, k: int, depth: int, length: int) -> torch.Tensor:
    """(B, length) whether, for t = 0..length-1, each of the tokens x_{t+1}..x_{t+1+depth} was among the base's `k`
    likeliest at the position before it (`topk_ids` (B, T, k'): the base's likeliest next tokens at each position):
    the contexts of head `depth` at t that decoding can reach (greedy, k = 1: the base's own choices)."""
    aligned = (x[:, 1:, None] == topk_ids[:, :-1, :k]).any(-1)  # (B, T-1): x_{p+1} among the k at p
    ok = aligned[:, :length].clone()
    for j in range(1, depth + 1):
        ok &= aligned[:, j : j + length]
    return ok


def head_losses(
    heads: DraftHeads,
    batch: dict[str, torch.Tensor],
    embed: torch.nn.Module,
    lm_weight: torch.Tensor,  # (V', H) rows of the draft vocabulary
    lm_bias: torch.Tensor | None,
    full_to_draft: torch.Tensor | None,  # (V,) draft index of each token, -1 if absent
    head_decay: float,
    feature_loss_weight: float,
    label_top_k: int | None = None,
    labels: str = "top_k",
    label_mask: int | None = None,
) -> tuple[torch.Tensor, list[dict[str, float]]]:
    """Weighted loss over heads and per-head stats (loss, top-1 and top-5 agreement with the base).

    `batch` holds `input_ids`, `loss_mask`, the base's `hidden`, `topk_ids` and `topk_probs` (and
    `target_logits` for labels="full", `inputs` for heads that read the states before the final norm),
    all (B, T, ...); with `position_ids`, rows of packed examples. With `label_mask`, head i learns at t only where
    each token x_{t+1}..x_{t+1+i} it reads was among the base's `label_mask` likeliest (`reached`).
    """
    h, x = batch["hidden"], batch["input_ids"]  # (B, T, H), (B, T)
    inputs = batch.get("inputs", h)  # what the heads read: the same states, or those before the final norm
    positions = batch.get("position_ids")
    outs = heads(inputs[:, :-1], embed(x[:, 1:]).to(h.dtype), None if positions is None else positions[:, :-1])
    docs = None if positions is None else document_ids(positions)
    project = getattr(heads, "module", heads).head_logits  # heads wrapped for DDP keep their methods on .module

    def draft_index(ids: torch.Tensor) -> torch.Tensor:  # -1 where a token is not in the draft vocabulary
        return ids if full_to_draft is None else full_to_draft[ids]

    rows = DraftLMHead(lm_weight, lm_bias)
    total, stats = h.new_zeros(()), []
    for i, u in enumerate(outs):  # u: (B, L, H) at t = 0..L-1, predicting x_{t+2+i}
        L = u.shape[1]
        valid = batch["loss_mask"][:, 2 + i : 2 + i + L]
        if docs is not None:  # the target must lie in the example of t
            valid = valid & (docs[:, 2 + i : 2 + i + L] == docs[:, :L])
        if label_mask is not None:
            valid = valid & reached(x, batch["topk_ids"], label_mask, i, L)
        at = slice(1 + i, 1 + i + L)  # the base's state and distribution that predict x_{t+2+i}
        best = draft_index(batch["topk_ids"][:, at][valid][:, 0])  # (n,) the base's top-1
        if labels == "data":
            tgt_ids = draft_index(x[:, 2 + i : 2 + i + L][valid])[:, None]  # (n, 1)
            tgt_p = (tgt_ids >= 0).to(torch.float32)
        elif labels == "full":
            tgt_p, tgt_ids = batch["target_logits"][:, at][valid].float().softmax(-1), None  # (n, V')
        else:
            tgt_ids = draft_index(batch["topk_ids"][:, at][valid][:, :label_top_k])  # (n, k)
            tgt_p = batch["topk_probs"][:, at][valid][:, :label_top_k].float() * (tgt_ids >= 0)
        keep = tgt_p.sum(-1) > 0  # positions with something to learn inside the draft vocabulary
        best, tgt_p = best[keep], tgt_p[keep] / tgt_p[keep].sum(-1, keepdim=True)
        hidden_valid = u[valid][keep]
        logits = project(i, hidden_valid, rows).float()  # (n, V')
        logp = logits.log_softmax(-1)
        n = max(1, logits.shape[0])  # a batch with no target for this head contributes 0, not NaN
        if tgt_ids is not None:
            logp = logp.gather(-1, tgt_ids[keep].clamp(min=0))
        ce = -(tgt_p * logp).sum() / n
        target_hidden = h[:, at][valid][keep].float()
        feat = F.smooth_l1_loss(hidden_valid.float(), target_hidden, reduction="sum") / (n * target_hidden.shape[-1])
        loss = ce + feature_loss_weight * feat
        total = total + head_decay**i * loss
        with torch.no_grad():
            top = logits.topk(min(RANKS, logits.shape[-1]), dim=-1).indices
            hits = (top == best[:, None]).float()  # (n, RANKS) one-hot rank of the base's top-1
            ranks = F.pad(hits.sum(0), (0, RANKS - hits.shape[1])) / max(1, hits.shape[0])
            stats.append({
                "loss": float(ce),
                "top1": float(ranks[0]),
                "top5": float(ranks[:5].sum()),
                "ranks": ranks.tolist(),
                "n": int(hits.shape[0]),
            })
    return total, stats


class Trainer:
    """Trains `heads` on cached features or, online, on packed rows that the base runs over inside each
    step; checkpoints so that an interrupted run resumes exactly."""

    def __init__(self, config: TrainConfig, heads: DraftHeads, base, data: FeatureSet | PackedRows,
                 accelerator: Accelerator | None = None, top_k: int = 8) -> None:
        self.config = config
        self.accelerator = accelerator or Accelerator(mixed_precision=config.mixed_precision)
        self.base = base
        self.data = data
        self.online = isinstance(data, PackedRows)
        self.top_k = top_k  # online: the base's likeliest tokens kept per position
        if config.labels == "full" and not self.online:
            raise ValueError("labels='full' learns the base's whole distribution, which cached features do not keep: "
                             "train online (--online) or use labels='top_k'")
        self.pre_norm, self.taps = heads.config.head_input == "pre_norm", heads.taps
        wanted = inputs_read(self.pre_norm, self.taps)
        # heads that read the last states take `hidden` from any shards; others need shards cached for them
        self.read_inputs = wanted != inputs_read(False, ())
        if not self.online and self.read_inputs and data.inputs_read() != wanted:
            raise ValueError(f"the heads read {wanted!r} (head_input, feature_layers), but the cached features hold "
                             f"{data.inputs_read()!r}: cache them again for these heads, or train online (--online)")
        self.out = Path(config.output_dir)
        n = len(data)
        g = torch.Generator().manual_seed(config.seed if config.eval_seed is None else config.eval_seed)
        order = torch.randperm(n, generator=g).tolist()
        n_eval = int(n * config.eval_fraction) if n > 1 else 0
        self.eval_ids, self.train_ids = order[:n_eval], order[n_eval:]
        if not self.train_ids:
            raise ValueError("no training sequences left after the evaluation split")
        self.total_steps = config.max_steps if config.epochs is None else \
            max(1, math.ceil(config.epochs * len(self.train_ids) / config.batch_size))
        lm_head = base.get_output_embeddings()
        device = self.accelerator.device
        self.embed = heads.token_embedding(base)
        rows = heads.draft_lm_head(lm_head)
        self.lm_weight = rows.weight.detach().float().to(device)
        self.lm_bias = None if rows.bias is None else rows.bias.detach().float().to(device)
        ids = heads.draft_token_ids
        self.draft_token_ids = None if ids is None else ids.to(device)
        if ids is not None:
            self.full_to_draft = torch.full((lm_head.weight.shape[0],), -1, dtype=torch.long, device=device)
            self.full_to_draft[self.draft_token_ids] = torch.arange(ids.numel(), device=device)
        else:
            self.full_to_draft = None
        optimizer = torch.optim.AdamW(heads.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_lambda(s, config.warmup_steps, self.total_steps, config.schedule)
        )
        self.heads, self.optimizer, self.scheduler = self.accelerator.prepare(heads.float(), optimizer, scheduler)
        self.step = 0
        self.fitted = False  # whether train_minutes has set total_steps
        self._timer = 0.0  # when this run's timed steps began (train_minutes)
        self.clock = time.monotonic  # seconds, for --max-minutes, --train-minutes and tokens/s

    # -- data order: a pure function of (seed, step), so resuming replays the same batches -----
    def batch_indices(self, step: int) -> list[int]:
        per_epoch = max(1, len(self.train_ids) // self.config.batch_size)
        epoch, k = divmod(step, per_epoch)
        g = torch.Generator().manual_seed(self.config.seed * 100_003 + epoch)
        perm = torch.randperm(len(self.train_ids), generator=g).tolist()
        chosen = perm[k * self.config.batch_size : (k + 1) * self.config.batch_size]
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        return [self.train_ids[j] for j in chosen[rank::world]] or [self.train_ids[chosen[0]]]

    def _device_batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        read = self.data.batch(indices) if self.online or self.read_inputs else self.data.batch(indices, ("inputs",))
        batch = {k: v.to(self.accelerator.device) for k, v in read.items()}
        if self.online:
            targets = base_targets(self.base, batch["input_ids"], self.top_k, batch["position_ids"],
                                   self.draft_token_ids, full=self.config.labels == "full", pre_norm=self.pre_norm,
                                   taps=self.taps)
            batch.update(targets, hidden=targets["hidden"].float())
            if "inputs" in targets:
                batch["inputs"] = targets["inputs"].float()
        return batch

    def _losses(self, batch, mask: bool = True):
        """The loss and per-head stats of a batch: with the training's label mask (`mask`), or at every position (its
        evaluation, comparable across masks)."""
        return head_losses(
            self.heads, batch, self.embed, self.lm_weight, self.lm_bias, self.full_to_draft,
            self.config.head_decay, self.config.feature_loss_weight, self.config.label_top_k, self.config.labels,
            self.config.label_mask if mask else None,
        )

    # -- checkpoints -----------------------------------------------------------------------
    def checkpoints(self) -> list[Path]:
        done = [p for p in (self.out / "checkpoints").glob("step-*") if (p / "trainer_state.json").exists()]
        return sorted(done, key=lambda p: int(p.name.split("-")[1]))

    def save_checkpoint(self) -> None:
        acc = self.accelerator
        final = self.out / "checkpoints" / f"step-{self.step:07d}"
        tmp = final.with_name(final.name + ".tmp")
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()  # every process writes its own RNG state into tmp
        acc.save_state(str(tmp))
        acc.wait_for_everyone()  # ... and has finished before tmp becomes the checkpoint
        if acc.is_main_process:
            state = {"step": self.step, "total_steps": self.total_steps, "fitted": self.fitted,
                     "config": asdict(self.config)}
            (tmp / "trainer_state.json").write_text(json.dumps(state))
            os.replace(tmp, final)  # a checkpoint exists only once it is complete
            for old in self.checkpoints()[:-2]:
                shutil.rmtree(old)
        acc.wait_for_everyone()

    def resume(self) -> bool:
        found = self.checkpoints()
        if not found:
            return False
        self.accelerator.load_state(str(found[-1]))
        state = json.loads((found[-1] / "trainer_state.json").read_text())
        self.step = state["step"]
        if state.get("fitted"):  # the length train_minutes chose holds for the rest of the run
            self.total_steps, self.fitted = state["total_steps"], True
        return True

    # -- loops -----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, max_sequences: int = 64) -> list[dict[str, float]]:
        """Per-head top-1/top-5 agreement with the base's top-1 on held-out sequences."""
        ids = self.eval_ids[:max_sequences] or self.train_ids[:max_sequences]
        ids = ids[self.accelerator.process_index :: self.accelerator.num_processes] or ids[:1]
        self.heads.eval()
        sums = None  # per head: [loss, rank counts..., n]
        for start in range(0, len(ids), 4):
            _, stats = self._losses(self._device_batch(ids[start : start + 4]), mask=False)
            rows = torch.tensor([[st["loss"] * st["n"], *(r * st["n"] for r in st["ranks"]), st["n"]] for st in stats])
            sums = rows if sums is None else sums + rows
        self.heads.train()
        sums = self.accelerator.reduce(sums.to(self.accelerator.device), reduction="sum").cpu()
        out = []
        for row in sums:
            n = max(float(row[-1]), 1.0)
            ranks = (row[1:-1] / n).tolist()
            out.append({"top1": ranks[0], "top5": sum(ranks[:5]), "loss": float(row[0]) / n, "ranks": ranks})
        return out

    def train(self, log=print) -> list[dict[str, float]] | None:
        """Train to the last step and return the final evaluation; None when stopped at `max_minutes`
        (with a checkpoint the next run resumes from)."""
        cfg, acc = self.config, self.accelerator
        if self.resume():
            log(f"resumed from step {self.step}")
        self.heads.train()
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step",
                   disable=not acc.is_main_process)
        started, tokens, done_here = self.clock(), 0, 0
        deadline = None if cfg.max_minutes is None else started + 60 * cfg.max_minutes
        while self.step < self.total_steps:
            indices = self.batch_indices(self.step)
            batch = self._device_batch(indices)
            loss, stats = self._losses(batch)
            acc.backward(loss)
            if cfg.grad_clip:
                acc.clip_grad_norm_(self.heads.parameters(), cfg.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step, done_here, now = self.step + 1, done_here + 1, self.clock()
            if cfg.train_minutes and not self.fitted:
                self._fit_length(done_here, now, log)
                bar.total = self.total_steps
            tokens += self.data.count_tokens(indices) * acc.num_processes
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", acc="/".join(f"{s['top1']:.2f}" for s in stats),
                            tok_s=f"{tokens / max(now - started, 1e-9):,.0f}")
            stop = deadline is not None and self._any_process(now >= deadline)
            if self.step % cfg.save_every == 0 or self.step == self.total_steps or stop:
                self.save_checkpoint()
            if stop and self.step < self.total_steps:
                bar.close()
                log(f"stopped after {cfg.max_minutes} minutes at step {self.step} of {self.total_steps} "
                    f"(checkpoint saved): run the same command again to continue")
                return None
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < self.total_steps:
                log(f"step {self.step} eval " + format_accuracy(self.evaluate()))
        bar.close()
        final = self.evaluate()
        log(f"final eval ({self.clock() - started:.0f} s this run) " + format_accuracy(final))
        return final

    def _fit_length(self, done_here: int, now: float, log) -> None:
        """With train_minutes: time this run's steps 3 to 8, then cut the run to the steps that fit."""
        first, last = TIMED_STEPS
        if done_here == first:
            self._timer = now
        elif done_here == last:
            per_step = torch.tensor([(now - self._timer) / (last - first)], device=self.accelerator.device)
            per_step = float(self.accelerator.reduce(per_step, reduction="mean"))  # one length for every process
            fits = int(60 * self.config.train_minutes / per_step)
            self.total_steps, self.fitted = max(self.step, min(self.total_steps, fits)), True
            log(f"{per_step:.3f} s a step: {self.total_steps} steps fit in {self.config.train_minutes} minutes")

    def _any_process(self, flag: bool) -> bool:
        """Whether any process says so (each process reads its own clock; all must stop at the same step)."""
        if self.accelerator.num_processes == 1:
            return flag
        t = torch.tensor([float(flag)], device=self.accelerator.device)
        return bool(self.accelerator.reduce(t, reduction="sum").item() > 0)


def format_accuracy(stats: list[dict[str, float]]) -> str:
    return " ".join(f"head{i}: top1 {s['top1']:.3f} top5 {s['top5']:.3f}" for i, s in enumerate(stats))
