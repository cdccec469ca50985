"""Training draft heads (Clover's, or the Medusa baseline's) on a frozen base: one Accelerate loop on
CPU, one GPU, or many processes.

Per head i the loss is cross-entropy against the base's own top-k next-token distribution at the
target position (soft labels, restricted to the draft vocabulary) plus a SmoothL1 pull of the head's
output features toward the base's hidden state there, weighted head_decay ** i (Clover-2 recipe).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from tqdm.auto import tqdm

from .config import check_head_type
from .features import FeatureSet
from .heads import DraftHeads, DraftLMHead

RANKS = 10  # evaluation records where the base's top-1 falls among each head's top-10 (shapes the tree)


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
    own_lm_heads: bool = field(
        default=False, metadata={"help": "Medusa: a vocabulary projection per head, from the base's lm_head (Medusa-1)."}
    )
    label_top_k: int | None = field(
        default=None, metadata={"help": "Soft labels from the base's top-k tokens, renormalised (1: its top-1 alone, "
                                        "as cross-entropy on hard labels; None: all the k cached)."}
    )
    draft_vocab_size: int | None = field(default=8192, metadata={"help": "Frequent tokens to draft from (None: all)."})
    max_steps: int = field(default=1000, metadata={"help": "Optimizer steps."})
    batch_size: int = field(default=8, metadata={"help": "Sequences per optimizer step, over all processes."})
    lr: float = field(default=1e-3, metadata={"help": "Peak AdamW learning rate."})
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_steps: int = field(default=50, metadata={"help": "Linear warmup, then linear decay to 0."})
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
    mixed_precision: str = field(default="no", metadata={"help": "Accelerate mixed precision: no, bf16, fp16."})

    def __post_init__(self) -> None:
        if self.max_steps < 1 or self.batch_size < 1:
            raise ValueError("max_steps and batch_size must be >= 1")
        check_head_type(self.head_type)  # here too, so a bad value fails before features are cached
        if self.label_top_k is not None and self.label_top_k < 1:
            raise ValueError(f"label_top_k must be >= 1 (or None: every cached token), got {self.label_top_k}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
        self.betas = tuple(self.betas)


def lr_lambda(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


def choose_draft_vocab(counts: torch.Tensor, size: int | None) -> torch.Tensor | None:
    """The `size` most frequent target tokens, sorted by id."""
    if size is None or size >= counts.numel():
        return None
    return counts.topk(size).indices.sort().values


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
) -> tuple[torch.Tensor, list[dict[str, float]]]:
    """Weighted loss over heads and per-head stats (loss, top-1 and top-5 agreement with the base)."""
    h, x = batch["hidden"], batch["input_ids"]  # (B, T, H), (B, T)
    outs = heads(h[:, :-1], embed(x[:, 1:]).to(h.dtype))  # head i: (B, T-2-i, H) at t = 0..T-3-i
    project = getattr(heads, "module", heads).head_logits  # heads wrapped for DDP keep their methods on .module
    rows = DraftLMHead(lm_weight, lm_bias)
    total, stats = h.new_zeros(()), []
    for i, u in enumerate(outs):
        L = u.shape[1]
        valid = batch["loss_mask"][:, 2 + i : 2 + i + L]
        tgt_ids = batch["topk_ids"][:, 1 + i : 1 + i + L][valid][:, :label_top_k]  # (n, k) base's top-k for x_{t+2+i}
        tgt_p = batch["topk_probs"][:, 1 + i : 1 + i + L][valid][:, :label_top_k]
        if full_to_draft is not None:
            tgt_ids = full_to_draft[tgt_ids]
            tgt_p = tgt_p * (tgt_ids >= 0)
        keep = tgt_p.sum(-1) > 0
        best = tgt_ids[keep][:, 0]  # the base's top-1 as a draft index; -1 when it cannot be drafted
        tgt_ids, tgt_p = tgt_ids[keep].clamp(min=0), tgt_p[keep] / tgt_p[keep].sum(-1, keepdim=True)
        hidden_valid = u[valid][keep]
        logits = project(i, hidden_valid, rows).float()  # (n, V')
        logp = logits.log_softmax(-1)
        n = max(1, logits.shape[0])  # a batch with no target for this head contributes 0, not NaN
        ce = -(tgt_p * logp.gather(-1, tgt_ids)).sum() / n
        target_hidden = batch["hidden"][:, 1 + i : 1 + i + L][valid][keep].float()
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
    """Trains `heads` on cached features; checkpoints so that an interrupted run resumes exactly."""

    def __init__(self, config: TrainConfig, heads: DraftHeads, base, features: FeatureSet,
                 accelerator: Accelerator | None = None) -> None:
        self.config = config
        self.accelerator = accelerator or Accelerator(mixed_precision=config.mixed_precision)
        self.base = base
        self.features = features
        self.out = Path(config.output_dir)
        n = len(features)
        g = torch.Generator().manual_seed(config.seed)
        order = torch.randperm(n, generator=g).tolist()
        n_eval = int(n * config.eval_fraction) if n > 1 else 0
        self.eval_ids, self.train_ids = order[:n_eval], order[n_eval:]
        if not self.train_ids:
            raise ValueError("no training sequences left after the evaluation split")
        lm_head = base.get_output_embeddings()
        device = self.accelerator.device
        self.embed = base.get_input_embeddings()
        rows = heads.draft_lm_head(lm_head)
        self.lm_weight = rows.weight.detach().float().to(device)
        self.lm_bias = None if rows.bias is None else rows.bias.detach().float().to(device)
        ids = heads.draft_token_ids
        if ids is not None:
            self.full_to_draft = torch.full((lm_head.weight.shape[0],), -1, dtype=torch.long, device=device)
            self.full_to_draft[ids.to(device)] = torch.arange(ids.numel(), device=device)
        else:
            self.full_to_draft = None
        optimizer = torch.optim.AdamW(heads.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_lambda(s, config.warmup_steps, config.max_steps)
        )
        self.heads, self.optimizer, self.scheduler = self.accelerator.prepare(heads.float(), optimizer, scheduler)
        self.step = 0

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
        return {k: v.to(self.accelerator.device) for k, v in self.features.batch(indices).items()}

    def _losses(self, batch):
        return head_losses(
            self.heads, batch, self.embed, self.lm_weight, self.lm_bias, self.full_to_draft,
            self.config.head_decay, self.config.feature_loss_weight, self.config.label_top_k,
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
            (tmp / "trainer_state.json").write_text(json.dumps({"step": self.step, "config": asdict(self.config)}))
            os.replace(tmp, final)  # a checkpoint exists only once it is complete
            for old in self.checkpoints()[:-2]:
                shutil.rmtree(old)
        acc.wait_for_everyone()

    def resume(self) -> bool:
        found = self.checkpoints()
        if not found:
            return False
        self.accelerator.load_state(str(found[-1]))
        self.step = json.loads((found[-1] / "trainer_state.json").read_text())["step"]
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
            _, stats = self._losses(self._device_batch(ids[start : start + 4]))
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

    def train(self, log=print) -> list[dict[str, float]]:
        cfg, acc = self.config, self.accelerator
        if self.resume():
            log(f"resumed from step {self.step}")
        self.heads.train()
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="train", disable=not acc.is_main_process)
        started = time.time()
        while self.step < cfg.max_steps:
            batch = self._device_batch(self.batch_indices(self.step))
            loss, stats = self._losses(batch)
            acc.backward(loss)
            if cfg.grad_clip:
                acc.clip_grad_norm_(self.heads.parameters(), cfg.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", acc="/".join(f"{s['top1']:.2f}" for s in stats))
            if self.step % cfg.save_every == 0 or self.step == cfg.max_steps:
                self.save_checkpoint()
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.max_steps:
                log(f"step {self.step} eval " + format_accuracy(self.evaluate()))
        bar.close()
        final = self.evaluate()
        log(f"final eval ({time.time() - started:.0f} s this run) " + format_accuracy(final))
        return final


def format_accuracy(stats: list[dict[str, float]]) -> str:
    return " ".join(f"head{i}: top1 {s['top1']:.3f} top5 {s['top5']:.3f}" for i, s in enumerate(stats))
