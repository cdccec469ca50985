"""Training data for the heads: self-distilled responses, tokenization, and cached base features.

The base model runs once per training sequence; its last hidden states and top-k next-token
distributions (and, for heads that read other states, those) are stored in safetensors shards, read
memory-mapped, so training epochs never touch the base again.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from clover_hf.base.forward import fused
from clover_hf.base.parts import layer_outputs, norm_inputs

from .data import Conversation, Record
from .packing import Example

FEATURE_KEYS = ("input_ids", "loss_mask", "hidden", "topk_ids", "topk_probs")
BATCH_DTYPES = {"input_ids": torch.long, "loss_mask": torch.bool, "hidden": torch.float32, "topk_ids": torch.long,
                "topk_probs": torch.float32, "inputs": torch.float32}  # what a batch holds each in


def inputs_read(pre_norm: bool, taps: tuple[int, ...]) -> str:
    """How a shard names the states its `inputs` hold (checked against the heads that train on them)."""
    return ("pre_norm" if pre_norm else "post_norm") + "".join(f",{t}" for t in taps)


def write_shard(tensors: dict[str, torch.Tensor], target: Path, inputs: str) -> None:
    """Write a shard under a temporary name and rename it once complete (an interrupted run never leaves half of one);
    its metadata names what its `inputs` hold."""
    tmp = target.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"inputs": inputs})
    os.replace(tmp, target)


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id prompts as one left-padded batch, as decoder-only batched generation takes them: (ids, mask)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    return ids, mask


def first_prompt(conversation: Conversation) -> Conversation:
    """The messages up to and including the first user turn (system prompt kept)."""
    for i, message in enumerate(conversation):
        if message["role"] == "user":
            return conversation[: i + 1]
    raise ValueError("conversation has no user turn")


def self_distill(
    base, tokenizer, prompts: list[Conversation], path: str | Path, max_new_tokens: int = 256,
    batch_size: int = 16, rank: int = 0, world_size: int = 1, max_prompt_tokens: int = 512,
    max_seconds: float | None = None,
) -> list[Conversation]:
    """Answer prompts with the base's own greedy generations, appending to a JSONL file per process.

    Resumable: prompts already answered in `path` are skipped. Each process answers every
    `world_size`-th prompt, shortest first, until done or `max_seconds` have passed. Returns this
    process's conversations (prompt + base response).
    """
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    path = Path(path)
    done: dict[int, Conversation] = {}
    if path.exists():
        records = read_distilled(path)
        done = {record["index"]: record["messages"] for record in records}
        if not path.read_bytes().endswith(b"\n"):  # drop the line an interruption cut short
            path.write_text("".join(json.dumps(r) + "\n" for r in records))
    todo = [i for i in range(rank, len(prompts), world_size) if i not in done]
    encoded = {
        i: tokenizer.apply_chat_template(prompts[i], add_generation_prompt=True, tokenize=True, return_dict=False)
        for i in todo
    }
    todo = sorted((i for i in todo if len(encoded[i]) <= max_prompt_tokens), key=lambda i: len(encoded[i]))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    bar = tqdm(total=len(todo), desc=f"self-distill[{rank}]", disable=rank != 0 and world_size > 1)
    with path.open("a") as out:
        for start in range(0, len(todo), batch_size):
            if deadline is not None and time.monotonic() >= deadline:
                break
            batch = todo[start : start + batch_size]
            ids, mask = left_padded([encoded[i] for i in batch], pad_id)
            width = ids.shape[1]
            gen = base.generate(
                input_ids=ids.to(base.device), attention_mask=mask.to(base.device), max_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=pad_id,
            )
            for row, i in enumerate(batch):
                reply = tokenizer.decode(gen[row, width:], skip_special_tokens=True).strip()
                if reply:
                    done[i] = prompts[i] + [{"role": "assistant", "content": reply}]
                    out.write(json.dumps({"index": i, "messages": done[i]}) + "\n")
            out.flush()
            bar.update(len(batch))
    bar.close()
    return [done[i] for i in sorted(done)]


def read_distilled(path: str | Path) -> list[dict]:
    """Records of a self-distillation file; a last line cut short by an interruption is dropped."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    records = []
    for n, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if n != len(lines) - 1:
                raise ValueError(f"{path}:{n + 1} is not valid JSON; delete the file to regenerate") from None
    return records


def tokenize_record(record: Record, tokenizer, max_length: int) -> Example | None:
    """Token ids and loss mask; chats go through the chat template and train on assistant turns only."""
    if isinstance(record, str):
        ids = tokenizer(record, add_special_tokens=True)["input_ids"][:max_length]
        return Example(ids, [1] * len(ids)) if len(ids) >= 4 else None

    def encode(messages: Conversation, prompt: bool) -> list[int]:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True, return_dict=False)

    ids = encode(record, prompt=False)
    mask = [0] * len(ids)
    for k, message in enumerate(record):
        if message["role"] == "assistant":
            start, end = len(encode(record[:k], prompt=True)), len(encode(record[: k + 1], prompt=False))
            mask[start:end] = [1] * (end - start)
    ids, mask = ids[:max_length], mask[:max_length]
    return Example(ids, mask) if sum(mask) >= 4 else None


_worker_args: tuple = ()  # (tokenizer, max_length) of a tokenizing worker process, set by its initializer


def _init_worker(tokenizer, max_length: int) -> None:
    global _worker_args
    _worker_args = (tokenizer, max_length)


def _tokenize_in_worker(record: Record) -> Example | None:
    return tokenize_record(record, *_worker_args)


def tokenize_records(records: list[Record], tokenizer, max_length: int, workers: int = 1) -> list[Example]:
    """The examples of `records` that have tokens to train on, in order; `workers` processes share the
    work (a chat template per conversation adds up to minutes over a large dataset in one process)."""
    if workers <= 1 or len(records) < 64 * workers:
        examples = [tokenize_record(r, tokenizer, max_length) for r in records]
    else:
        context = multiprocessing.get_context("spawn")  # no fork of a process that may hold CUDA or threads
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                                 initargs=(tokenizer, max_length)) as pool:
            examples = list(pool.map(_tokenize_in_worker, records, chunksize=64))
    return [e for e in examples if e is not None]


@torch.no_grad()
def base_targets(
    base, input_ids: torch.Tensor, top_k: int, position_ids: torch.Tensor | None = None,
    draft_token_ids: torch.Tensor | None = None, full: bool = False, pre_norm: bool = False, taps: tuple[int, ...] = (),
) -> dict[str, torch.Tensor]:
    """What the heads learn from, for token ids (B, T): the base's last hidden states `hidden` (B, T, H)
    and its next-token distribution, as its `top_k` likeliest tokens (`topk_ids`, `topk_probs`: (B, T, k))
    and, with `full`, as logits over the draft vocabulary (`target_logits`: (B, T, V'), all rows without
    one); with `pre_norm` or `taps`, what such heads read (`inputs`: the states before the final norm, after the
    outputs of the decoder layers `taps`, as `forward.base_forward` gives them). With `position_ids` restarting at 0
    per example, packed examples do not see each other.
    """
    extra = {} if position_ids is None else {"position_ids": position_ids}
    with norm_inputs(base) if pre_norm else contextlib.nullcontext([]) as captured, layer_outputs(base, taps) as tapped:
        out = base(input_ids=input_ids, output_hidden_states=True, use_cache=False, return_dict=True, **extra)
    top = out.logits.float().softmax(-1).topk(top_k, dim=-1)
    targets = {"hidden": out.hidden_states[-1], "topk_ids": top.indices, "topk_probs": top.values}
    if pre_norm or taps:
        targets["inputs"] = fused(tapped, captured[-1] if pre_norm else out.hidden_states[-1])
    if full:
        logits = out.logits if draft_token_ids is None else out.logits[..., draft_token_ids.to(out.logits.device)]
        targets["target_logits"] = logits.float()
    return targets


@torch.no_grad()
def cache_features(
    base, examples: list[Example], directory: str | Path, top_k: int = 8, rank: int = 0, world_size: int = 1,
    shard_tokens: int = 200_000, pre_norm: bool = False, taps: tuple[int, ...] = (),
) -> None:
    """Run the base over this process's share of examples; write shards of hidden states and top-k targets, and
    with `pre_norm` or `taps` what such heads read (`inputs`, as `base_targets` gives it).

    A shard is written to a temporary name and renamed when complete, so an interrupted run resumes
    from the last finished shard.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    mine = list(range(rank, len(examples), world_size))
    shards, current, tokens = [], [], 0
    for i in mine:
        current.append(i)
        tokens += len(examples[i].input_ids)
        if tokens >= shard_tokens:
            shards.append(current)
            current, tokens = [], 0
    if current:
        shards.append(current)
    bar = tqdm(total=len(mine), desc=f"features[{rank}]", disable=rank != 0 and world_size > 1)
    for s, indices in enumerate(shards):
        target = directory / f"shard-r{rank}-w{world_size}-{s:04d}.safetensors"
        if target.exists():
            bar.update(len(indices))
            continue
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in (*FEATURE_KEYS, "lengths")}
        for i in indices:
            ex = examples[i]
            ids = torch.tensor([ex.input_ids], device=base.device)
            got = base_targets(base, ids, top_k, pre_norm=pre_norm, taps=taps)
            if "inputs" in got:
                parts.setdefault("inputs", []).append(got["inputs"][0].to(torch.bfloat16).cpu())
            parts["input_ids"].append(ids[0].cpu().int())
            parts["loss_mask"].append(torch.tensor(ex.loss_mask, dtype=torch.uint8))
            parts["hidden"].append(got["hidden"][0].to(torch.bfloat16).cpu())
            parts["topk_ids"].append(got["topk_ids"][0].int().cpu())
            parts["topk_probs"].append(got["topk_probs"][0].half().cpu())
            parts["lengths"].append(torch.tensor([len(ex.input_ids)], dtype=torch.int64))
            bar.update(1)
        write_shard({k: torch.cat(v) for k, v in parts.items()}, target, inputs_read(pre_norm, taps))
    bar.close()


class FeatureSet:
    """Cached sequences over the shards of one or more directories, read memory-mapped: a batch reads its sequences'
    rows from the files (`safetensors.safe_open`), and no shard is ever loaded whole. Shards hold `input_ids`,
    `loss_mask`, `hidden` (the base's last states), `topk_ids`, `topk_probs` and `lengths`, and, where the heads read
    other states (fused layers, or before the final norm), those as `inputs`."""

    def __init__(self, files: list[Path]) -> None:
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        lengths = [h.get_tensor("lengths") for h in self._handles]
        counts = torch.tensor([0] + [len(n) for n in lengths])
        self.shard_of = torch.cat([torch.full((len(n),), i, dtype=torch.int64) for i, n in enumerate(lengths)])
        self.first = counts.cumsum(0)  # the global index of each shard's first sequence
        self.offsets = [torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)]) for n in lengths]
        self.lengths = torch.cat(lengths)
        first, ref = files[0], self._handles[0]
        self.keys = [k for k in (*FEATURE_KEYS, "inputs") if k in ref.keys()]
        self.shapes = {k: ref.get_slice(k).get_shape()[1:] for k in self.keys}  # each key's shape per position
        for f, h in zip(files[1:], self._handles[1:]):
            for key in ("hidden", "topk_ids", "inputs"):
                ours = h.get_slice(key).get_shape()[1:] if key in h.keys() else None
                theirs = self.shapes.get(key)
                if ours != theirs:
                    raise ValueError(
                        f"{f} holds '{key}' of width {ours} but {first} has {theirs}: features from different bases, "
                        "--top-k or heads' inputs (--feature-layers, --head-input) cannot be mixed")

    def __len__(self) -> int:
        return len(self.lengths)

    @classmethod
    def load(cls, *directories: str | Path) -> "FeatureSet":
        """Every shard of the given directories, in order; all must come from the same base."""
        files = []
        for directory in directories:
            found = sorted(Path(directory).glob("shard-*.safetensors"))
            if not found:
                raise FileNotFoundError(f"no feature shards in {directory}")
            files += found
        return cls(files)

    def inputs_read(self) -> str:
        """What the shards' `inputs` hold (`inputs_read`); "post_norm" where they hold none (the heads read `hidden`)."""
        return (self._handles[0].metadata() or {}).get("inputs", "post_norm") if "inputs" in self.keys else "post_norm"

    def _span(self, i: int) -> tuple[int, int, int]:
        shard = int(self.shard_of[i])
        j = i - int(self.first[shard])
        return shard, int(self.offsets[shard][j]), int(self.offsets[shard][j + 1])

    def batch(self, indices: list[int], without: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        """Right-padded batch of sequences (padding has loss_mask 0), the keys `without` names left unread."""
        spans = [self._span(i) for i in indices]
        width = max(e - s for _, s, e in spans)
        out = {}
        for key in (k for k in self.keys if k not in without):
            out[key] = torch.zeros(len(spans), width, *self.shapes[key], dtype=BATCH_DTYPES[key])
            for row, (shard, s, e) in enumerate(spans):
                out[key][row, : e - s] = self._handles[shard].get_slice(key)[s:e].to(BATCH_DTYPES[key])
        return out

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token is a training target (drives the draft vocabulary), read a shard at a time."""
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for h in self._handles:
            counts += torch.bincount(h.get_tensor("input_ids")[h.get_tensor("loss_mask").bool()].long(),
                                     minlength=vocab_size)
        return counts

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def count_tokens(self, indices: list[int]) -> int:
        """Tokens of these sequences."""
        return int(self.lengths[indices].sum())

    def read(self, key: str) -> torch.Tensor:
        """Every position's `key`, concatenated over the shards (for small sets and tests: it loads them all)."""
        return torch.cat([h.get_tensor(key) for h in self._handles])
