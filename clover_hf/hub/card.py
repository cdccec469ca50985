"""The model card (README.md) published with trained heads, rendered from `MODEL_CARD.md`.

The template is a `string.Template` (`${name}` placeholders) shipped inside the package; every value is
computed here from the heads' config and, when given, the trainer's `training_metrics.json`.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

import torch
from huggingface_hub import ModelCardData
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from clover_hf.core.user_cache import MARKER_FILE
from clover_hf.heads.config import CloverConfig
from clover_hf.heads.build import build_heads

TEMPLATE_NAME = "MODEL_CARD.md"
LIBRARY_NAME = "clover-hf"
TAGS = ["clover", "speculative-decoding", "draft-heads"]
# Data sources the trainer knows by name -> their Hub dataset ids (for the card's `datasets:` metadata).
KNOWN_DATASETS = {"sharegpt": "anon8231489123/ShareGPT_Vicuna_unfiltered"}
NO_FIGURES = "No training or acceptance figures were recorded for these heads."
UNKNOWN_REPO = "path/to/these-heads"


def load_template() -> Template:
    return Template(resources.files("clover_hf").joinpath(TEMPLATE_NAME).read_text(encoding="utf-8"))


def render_model_card(
    config: CloverConfig,
    metrics: dict[str, Any] | None = None,
    license: str | None = None,
    datasets: list[str] | None = None,
    repo_id: str | None = None,
) -> str:
    """README.md for heads with this config.

    `metrics` has the shape of the trainer's `training_metrics.json`: "training" (data, sizes, steps,
    seconds), "eval" (per head: top1, top5, loss), "data_config", "train_config"; optionally
    "benchmark" with "tokens_per_step" (and "speedup", "prompts"). `repo_id` is the repo the card is
    published in (used in the usage example).
    """
    metrics = metrics or {}
    base = config.base_model_name_or_path
    hub_base = base_model_hub_id(base)
    if datasets is None:
        datasets = [KNOWN_DATASETS[d] for d in _data_sources(metrics) if d in KNOWN_DATASETS] or None
    tags = TAGS + (["medusa"] if config.head_type == "medusa" else []) + (
        [config.base_model_type] if config.base_model_type else [])
    front = ModelCardData(
        base_model=hub_base, library_name=LIBRARY_NAME, license=license, datasets=datasets,
        pipeline_tag="text-generation", tags=tags, base_model_relation="adapter" if hub_base else None,
    ).to_yaml()

    name = hub_base or (Path(base).name if base else "an unnamed base model")
    revision = f" (revision `{config.base_revision}`)" if config.base_revision else ""
    if hub_base:
        source = f"[`{hub_base}`](https://huggingface.co/{hub_base}){revision}"
    elif base:
        source = f"`{base}`{revision}, a local path"
    else:
        source = "wherever `base_model=` points (the config names no base)"
    # The config's base reference is what from_pretrained(repo) loads: only a Hub id works elsewhere.
    config_names_hub_id = bool(base) and hub_base == base
    base_for_code = hub_base or "path/to/the/base-model"
    repo = repo_id or UNKNOWN_REPO
    if config_names_hub_id:
        load_line = f'model = CloverForCausalLM.from_pretrained("{repo}")  # also loads {hub_base}'
        note = ""
    else:
        load_line = f'model = CloverForCausalLM.from_pretrained("{repo}", base_model="{base_for_code}")'
        note = (
            f"\n\n`config.json` names the base as {f'`{base}`' if base else 'nothing'}, which is not a Hub repo id: "
            "pass `base_model=` to say where your copy of the base is."
        )
    values = dict(
        front_matter=front.strip(),
        base_name=f"`{name}`",
        base_source=source,
        base_cell=f"`{base or '-'}`{revision}",
        base_model_type=config.base_model_type or "-",
        base_note=note,
        base_for_code=base_for_code,
        load_line=load_line,
        num_heads=config.num_heads,
        **ARCHITECTURES[config.head_type](config),
        hidden_size=config.hidden_size,
        draft_vocab=(f"{config.draft_vocab_size:,} most frequent of {config.vocab_size:,} tokens"
                     if config.draft_vocab_size else f"all {config.vocab_size:,} tokens"),
        tree_summary=tree_summary(config),
        num_params=_count(num_parameters(config)),
        training=training_section(metrics),
    )
    return load_template().substitute(values)


def _clover_words(config: CloverConfig) -> dict[str, str]:
    return dict(
        heads_title="Clover draft heads",
        heads_style="[Clover](https://arxiv.org/abs/2405.00263)",
        body_row=(f"| Augmenting Block | {config.num_augment_layers} decoder layer(s), {config.num_attention_heads} "
                  f"attention heads ({config.num_key_value_heads} KV heads), MLP size {config.intermediate_size} |"),
        architecture_text=(
            "An Attention Decoder merges the base model's last hidden state with the embedding of the next token;\n"
            "the Augmenting Block runs over the accepted tokens with its own KV cache; head *i* drafts the token\n"
            "*i*+2 positions ahead, and through the Regressive Connection head *i*+1 also sees the token drafted at\n"
            "depth *i*. Every head's features go through the base model's frozen lm_head.\n\n"
            "Where this departs from Clover-2's public code: the Augmenting Block has "
            f"{config.num_augment_layers} layer(s) (Clover-2: 2),\n"
            "initialised from the base's last decoder layer where names and shapes match, as a Llama-style layer\n"
            "without biases or q/k norms (its final norm starts at ones unless the training facts below say it\n"
            "started from the base's final norm, as in Clover-2); " + _output_head_words(config)
        ),
    )


def _output_head_words(config: CloverConfig) -> str:
    if config.output_head == "linear":
        return ("the output heads are Clover-2's: norm(W0 s) for the\nfirst head, one norm(W [s; e]) shared by the "
                "others, W starting near the identity.")
    return ("head *i* is norm(s + SiLU(FC([s; e]))) with FC starting at zero\n(Clover-2: norm(W0 s) for the first "
            "head, one norm(W [s; e]) shared by the others).")


def _medusa_words(config: CloverConfig) -> dict[str, str]:
    return dict(
        heads_title="Medusa draft heads (the baseline for Clover)",
        heads_style="[Medusa](https://arxiv.org/abs/2401.10774)-1 (the baseline Clover is measured against)",
        body_row="| each head | one residual block, x + SiLU(Wx + b) |",
        architecture_text=(
            "Head *i* maps the base model's last hidden state through its own residual block to the token *i*+2\n"
            "positions ahead, without seeing the tokens drafted before it, so every node of a depth draws from the\n"
            "same top-k. " + ("Each head projects to the draft vocabulary with weights of its own, initialised\n"
                              "from the base model's lm_head rows, as in Medusa-1."
                              if config.own_lm_heads else
                              "The heads share the base model's frozen lm_head (restricted to the draft vocabulary),\n"
                              "where Medusa-1 trains a projection per head.") +
            " The training facts below give the loss\n(Medusa-1: cross-entropy alone)."
        ),
    )


ARCHITECTURES = {"clover": _clover_words, "medusa": _medusa_words}  # card wording per CloverConfig.head_type


def tree_summary(config: CloverConfig) -> str:
    """The draft settings in words, e.g. "static, 10 nodes, depth 3, plus a prompt-lookup chain of up to 8 tokens"."""
    def dynamic(t: dict[str, int]) -> str:
        return f"dynamic: {t['nodes']} nodes chosen each step, depth {t['depth']}, width {t['width']}"

    if config.dynamic_tree:
        text = dynamic(config.dynamic_tree)
    else:
        text = f"static, {len(config.tree)} nodes, depth {max(len(p) for p in config.tree)}"
    if config.lookup_tokens:
        text += f", plus a prompt-lookup chain of up to {config.lookup_tokens} tokens"
        if config.lookup_max_tokens > config.lookup_tokens:
            text += f" that doubles up to {config.lookup_max_tokens} while the text copies earlier text"
    if config.accelerator_dynamic_tree:
        text += f"; on a GPU or other accelerator, at batch size 1, the tree is {dynamic(config.accelerator_dynamic_tree)}"
    return text


def write_model_card(directory: str | Path, config: CloverConfig, metrics: dict[str, Any] | None = None,
                     **kwargs: Any) -> Path:
    path = Path(directory) / "README.md"
    path.write_text(render_model_card(config, metrics, **kwargs), encoding="utf-8")
    return path


def base_model_hub_id(name: str | None) -> str | None:
    """The Hub repo id of a base reference: the id itself, the source of an embedded conversion, or None."""
    if not name:
        return None
    path = Path(name).expanduser()
    marker = path / MARKER_FILE
    if marker.is_file():  # a local conversion of a Hub model (see embedded.py) names its source
        try:
            name = json.loads(marker.read_text()).get("base_model")
        except (OSError, ValueError, AttributeError):
            return None
        return name if _is_repo_id(name) else None
    return name if _is_repo_id(name) and not path.exists() else None


def _is_repo_id(name: Any) -> bool:
    if not isinstance(name, str) or name.count("/") != 1 or name.startswith((".", "~")):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def num_parameters(config: CloverConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in build_heads(config).parameters())


def training_section(metrics: dict[str, Any]) -> str:
    """Markdown for "Training and acceptance": measured figures only, or a line saying there are none."""
    evals = metrics.get("eval") or []
    training = metrics.get("training") or {}
    bench = metrics.get("benchmark") or {}
    tps = bench.get("tokens_per_step", metrics.get("tokens_per_step"))
    if not (evals or training or tps or metrics.get("notes")):
        return NO_FIGURES
    parts = []
    if evals:
        rows = [
            f"| {i} | t+{i + 2} | {_pct(s.get('top1'))} | {_pct(s.get('top5'))} | {_num(s.get('loss'))} |"
            for i, s in enumerate(evals)
        ]
        parts.append(
            "Accuracy of each head on held-out sequences at the end of training (teacher-forced): how often "
            "its top-1 draft, or one of its top-5, is the base model's own greedy choice.\n\n"
            "| head | drafts | top-1 | top-5 | loss |\n|---|---|---|---|---|\n" + "\n".join(rows)
        )
    facts = _training_facts(metrics, training)
    if tps is not None:
        line = f"- Tokens per base forward pass (greedy): {float(tps):.2f}"
        if bench.get("speedup") is not None:
            line += f", {float(bench['speedup']):.2f}x the base model's own `generate`"
        if bench.get("prompts"):
            line += f", on {bench['prompts']}"
        facts.append(line)
    else:
        facts.append("- Tokens per base forward pass: not measured for this card.")
    facts += [f"- {note}" for note in metrics.get("notes", [])]
    parts.append("\n".join(facts))
    return "\n\n".join(parts)


def _training_facts(metrics: dict[str, Any], training: dict[str, Any]) -> list[str]:
    data_cfg = metrics.get("data_config") or {}
    train_cfg = metrics.get("train_config") or {}
    facts = []
    sources = _data_sources(metrics)
    if sources:
        line = "- Data: " + ", ".join(f"`{s}`" for s in sources)
        if training.get("self_distill", data_cfg.get("self_distill")):
            line += " (responses regenerated by the base model itself: self-distillation)"
        sizes = [f"{training[k]:,} {k}" for k in ("sequences", "tokens") if isinstance(training.get(k), int)]
        if sizes:
            line += "; " + ", ".join(sizes)
        if data_cfg.get("max_length"):
            line += f"; sequences cut at {data_cfg['max_length']} tokens"
        facts.append(line)
    steps = training.get("steps", train_cfg.get("max_steps"))
    if steps:
        line = f"- Steps: {steps:,} optimizer steps" if isinstance(steps, int) else f"- Steps: {steps} optimizer steps"
        batch = training.get("batch_size", train_cfg.get("batch_size"))
        if batch:
            line += f" of {batch} sequences"
        if train_cfg.get("lr") is not None:
            line += f", AdamW peak lr {train_cfg['lr']:g}"
        facts.append(line)
    if training.get("total_seconds") is not None:
        line = f"- Time: {_duration(training['total_seconds'])} in all"
        if training.get("prepare_seconds") is not None:
            line += f" ({_duration(training['prepare_seconds'])} of it preparing data and base features)"
        if training.get("processes"):
            line += f", {training['processes']} process{'es' if training['processes'] != 1 else ''}"
        facts.append(line)
    loss = _loss_words(train_cfg)
    if loss:
        facts.append(loss)
    if data_cfg.get("base_dtype"):
        facts.append(f"- Base model run in {data_cfg['base_dtype']} for training")
    return facts


def _loss_words(train_cfg: dict[str, Any]) -> str | None:
    """The loss and initialisation the training configuration names, as one fact line."""
    if "feature_loss_weight" not in train_cfg:
        return None
    k = train_cfg.get("label_top_k")
    labels = ("cross-entropy on the base's top-1 token" if k == 1 else
              f"cross-entropy on the base's top-{k} tokens, renormalised" if k else
              "cross-entropy on the base's cached top-k tokens, renormalised")
    line = f"- Loss per head: {labels}, plus {train_cfg['feature_loss_weight']:g} x SmoothL1 to the base's hidden state"
    if train_cfg.get("head_decay") is not None:
        line += f"; head *i* weighted {train_cfg['head_decay']:g}^*i*"
    if train_cfg.get("init_norms_from_base"):
        line += "; the Augmenting Block's final norm started from the base's final norm"
    if train_cfg.get("label_mask"):
        line += (f"; positions learnt only where each token a head reads was among the base's "
                 f"{train_cfg['label_mask']} likeliest (GRIFFIN's loss mask)")
    if train_cfg.get("feature_layers"):
        line += f"; the heads read decoder layers {train_cfg['feature_layers']} fused with the last hidden state"
    return line


def _data_sources(metrics: dict[str, Any]) -> list[str]:
    data = (metrics.get("training") or {}).get("data") or (metrics.get("data_config") or {}).get("data") or []
    return [data] if isinstance(data, str) else [str(d) for d in data]


def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * float(x):.1f}%"


def _num(x: Any) -> str:
    return "-" if x is None else f"{float(x):.3f}"


def _count(n: int) -> str:
    return f"{n:,} ({n / 1e6:.1f}M)" if n >= 100_000 else f"{n:,}"


def _duration(seconds: float) -> str:
    s = int(round(float(seconds)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"
