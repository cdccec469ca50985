"""Self-distillation by Clover itself: the base's own greedy answers to prompts, generated in batches with the heads
and the machine's kernels, their features kept as decoding computes them (`decode.record.FeatureRecord`: no second
forward), written as feature shards that training reads memory-mapped (`features.FeatureSet`).

A run keeps a manifest beside its shards: what made them (base, heads, dtype, top-k, the states the heads read, the
prompts) and which prompts each shard answers. Run again with the same arguments, it goes on where it stopped: a
shard is renamed into place once complete, and the manifest, replaced atomically, names only complete shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from clover_hf.base.parts import final_norm
from clover_hf.core.user_cache import default_cache_dir
from clover_hf.decode.record import FeatureRecord

from .data import Conversation
from .features import inputs_read, left_padded, write_shard

MANIFEST = "manifest.json"


@dataclass
class Manifest:
    """What made a directory's shards, and which prompts (by index) each answers."""

    settings: dict
    shards: list[dict] = field(default_factory=list)  # {"file", "prompts", "sequences", "tokens", "seconds"}

    @property
    def done(self) -> set[int]:
        return {i for shard in self.shards for i in shard["prompts"]}

    @property
    def tokens(self) -> int:
        return sum(shard["tokens"] for shard in self.shards)

    @classmethod
    def read(cls, directory: Path) -> Manifest | None:
        path = directory / MANIFEST
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        return cls(data["settings"], data["shards"])

    def write(self, directory: Path) -> None:
        tmp = directory / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, directory / MANIFEST)


def default_directory(settings: dict) -> Path:
    """Where a run's shards go unless told: the user cache, under a name read off what makes them."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    name = str(settings["base"]).rstrip("/").split("/")[-1] or "base"
    return default_cache_dir() / "distill" / f"{name}-{digest}"


def distill_settings(clover, prompts: list[Conversation], base_name: str, heads_name: str, top_k: int,
                     max_new_tokens: int, max_prompt_tokens: int) -> dict:
    """What a run's shards depend on; a directory holding shards made otherwise is refused."""
    heads = clover.clover_heads
    return {
        "base": base_name, "heads": heads_name, "dtype": str(clover.base_model.dtype).removeprefix("torch."),
        "top_k": top_k, "inputs": inputs_read(heads.config.head_input == "pre_norm", tuple(heads.taps)),
        "max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens, "prompts": len(prompts),
        "prompts_digest": hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16],
    }


def open_run(directory: Path, settings: dict) -> Manifest:
    """The directory's manifest (new, or the one an earlier run left with the same settings)."""
    directory.mkdir(parents=True, exist_ok=True)
    manifest = Manifest.read(directory)
    if manifest is None:
        manifest = Manifest(settings)
        manifest.write(directory)
    elif manifest.settings != settings:
        differ = sorted(k for k in set(settings) | set(manifest.settings)
                        if settings.get(k) != manifest.settings.get(k))
        raise ValueError(f"{directory} holds shards made with other settings ({', '.join(differ)}): pass another "
                         "--out, or the arguments that made them to go on with that run")
    return manifest


@torch.no_grad()
def distill(clover, tokenizer, prompts: list[Conversation], directory: str | Path, settings: dict,
            batch_size: int = 4, shard_tokens: int = 200_000, max_seconds: float | None = None,
            log=print) -> tuple[Manifest, int]:
    """Answer `prompts` greedily with `clover` (shortest first, `batch_size` at a time) and write each answer's
    features into shards of about `shard_tokens` tokens in `directory`, skipping prompts its manifest says are done
    and those longer than `max_prompt_tokens`; stop after `max_seconds` (the shard in progress is written first).
    Returns the manifest and how many prompts are left to answer."""
    directory = Path(directory)
    manifest = open_run(directory, settings)
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    encoded = {i: tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
               for i, p in enumerate(prompts) if i not in manifest.done}
    todo = sorted((i for i, ids in encoded.items() if len(ids) <= settings["max_prompt_tokens"]),
                  key=lambda i: len(encoded[i]))
    pad_id = next(t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if t is not None)
    log(f"{len(manifest.done)} of {len(prompts)} prompts answered in {directory} ({manifest.tokens} tokens); "
        f"{len(todo)} to go" + (f", {len(encoded) - len(todo)} longer than {settings['max_prompt_tokens']} tokens "
                                "left out" if len(encoded) > len(todo) else ""))
    answered = 0
    shard, started, bar = _Shard(), time.monotonic(), tqdm(total=len(todo), desc="distill", unit="prompt")
    for n, start in enumerate(range(0, len(todo), batch_size)):
        if deadline is not None and time.monotonic() >= deadline:
            break
        batch = todo[start : start + batch_size]
        shard.add(batch, _answer(clover, [encoded[i] for i in batch], pad_id, settings))
        answered += len(batch)
        bar.update(len(batch))
        if n == 0 and len(todo) > batch_size:
            each = time.monotonic() - started
            log(f"about {each * len(todo) / len(batch) / 60:.0f} min for {len(todo)} prompts "
                f"({each:.1f} s for the first {len(batch)}, the shortest: longer ones take more)")
        if shard.tokens >= shard_tokens:
            shard.write(directory, manifest, settings["inputs"])
            shard = _Shard()
    shard.write(directory, manifest, settings["inputs"])
    bar.close()
    return manifest, len(todo) - answered


class _Shard:
    """The sequences answered since the last shard was written."""

    def __init__(self) -> None:
        self.prompts: list[int] = []
        self.parts: dict[str, list[torch.Tensor]] = {}
        self.tokens, self.started = 0, time.monotonic()

    def add(self, prompts: list[int], sequences: list[dict[str, torch.Tensor]]) -> None:
        self.prompts += prompts
        for seq in sequences:
            for key, value in seq.items():
                self.parts.setdefault(key, []).append(value)
            self.tokens += seq["input_ids"].shape[0]

    def write(self, directory: Path, manifest: Manifest, inputs: str) -> None:
        if not self.prompts:
            return
        name = f"shard-{len(manifest.shards):05d}.safetensors"
        write_shard({k: torch.cat(v) for k, v in self.parts.items()}, directory / name, inputs)
        manifest.shards.append({"file": name, "prompts": self.prompts, "sequences": len(self.parts["lengths"]),
                                "tokens": self.tokens, "seconds": round(time.monotonic() - self.started, 1)})
        manifest.write(directory)


def _answer(clover, prompts: list[list[int]], pad_id: int, settings: dict) -> list[dict[str, torch.Tensor]]:
    """One batch of token-id prompts answered, each as a sequence of the shards: its text (the prompt, then the answer,
    the only positions it learns from) and the features at every position, the last's zero (never read)."""
    ids, mask = left_padded(prompts, pad_id)
    width = ids.shape[1]
    record = FeatureRecord(settings["top_k"])
    device = clover.base_model.device
    out = clover.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False,
                          max_new_tokens=settings["max_new_tokens"], pad_token_id=pad_id, clover_record=record)
    base, hidden_size = clover.base_model, clover.base_model.config.get_text_config().hidden_size
    sequences = []
    for row, (p, features) in enumerate(zip(prompts, record.rows)):
        got = features.tensors()  # every position but the text's last (past which rows that stopped early are padded)
        text = out[row, width - len(p): width - len(p) + got["states"].shape[0] + 1].cpu()
        states = _pad(got["states"], len(text))
        last = states[:, -hidden_size:]
        if settings["inputs"].startswith("pre_norm"):  # the feature loss's target: the base's last hidden state
            last = final_norm(base)(last.to(base.dtype).to(device)).to(torch.bfloat16).cpu()
        seq = {"input_ids": text.int(), "loss_mask": (torch.arange(len(text)) >= len(p)).to(torch.uint8),
               "hidden": last, "topk_ids": _pad(got["topk_ids"], len(text)),
               "topk_probs": _pad(got["topk_probs"], len(text)), "lengths": torch.tensor([len(text)])}
        if settings["inputs"] != "post_norm":
            seq["inputs"] = states
        sequences.append(seq)
    return sequences


def _pad(t: torch.Tensor, length: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(1, t.shape[1])])[:length]


def run_distill(heads: str | None = None, base_model: str | None = None, data: list[str] | None = None,
                max_records: int | None = None, skip_records: int = 0, dtype: str = "bfloat16", top_k: int = 8,
                max_new_tokens: int = 256, max_prompt_tokens: int = 512, batch_size: int = 4,
                shard_tokens: int = 200_000, out: str | None = None, max_minutes: float | None = None,
                log=print) -> Path:
    """`clover-hf distill`: the first user turns of `data` (default: ShareGPT) answered by `heads` (default: the
    shipped SmolLM2 heads on the embedded base) into feature shards in `out` (default: the user cache). Returns the
    directory; the same command again goes on where a run stopped."""
    from transformers import AutoTokenizer

    from clover_hf import embedded
    from clover_hf.modeling import CloverForCausalLM

    from .features import first_prompt
    from .pipeline import SHAREGPT, read_records

    torch_dtype = getattr(torch, dtype)
    heads, base_path = embedded.heads_and_base(heads, base_model, torch_dtype)
    clover = CloverForCausalLM.from_pretrained(heads, base_model=base_path, dtype=torch_dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(clover.base_model.config._name_or_path)
    records = read_records(data or [SHAREGPT], max_records, skip_records)
    prompts = [first_prompt(r) for r in records if not isinstance(r, str)]
    if not prompts:
        raise ValueError("distilling needs chat records (prompts to answer), found plain text only")
    base_name = base_model or clover.clover_config.base_model_name_or_path or base_path
    settings = distill_settings(clover, prompts, base_name, heads, top_k, max_new_tokens, max_prompt_tokens)
    directory = Path(out).expanduser() if out else default_directory(settings)
    manifest, left = distill(clover, tokenizer, prompts, directory, settings, batch_size, shard_tokens,
                             None if max_minutes is None else 60 * max_minutes, log)
    log(f"{len(manifest.done)} prompts answered, {manifest.tokens} tokens in {len(manifest.shards)} shards in "
        f"{directory}" + (f"; {left} left: the same command goes on where this stopped" if left else ""))
    log(f"train on them: clover-hf train --base-model {base_name} --features {directory} ...")
    return directory
