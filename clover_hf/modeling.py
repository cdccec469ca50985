"""CloverForCausalLM: a frozen base causal LM plus Clover heads, generating through `generate`."""

from __future__ import annotations

import copy
import inspect
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import HfApi
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig, GenerationMixin, PreTrainedModel, StoppingCriteriaList
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import StopStringCriteria

from clover_hf import cpu
from clover_hf.base.architectures import ALIBI, RECURRENT, architecture
from clover_hf.base.cache import capacity, given_cache, is_static, static_sliding_layers
from clover_hf.base.forward import MaskLayout
from clover_hf.base.parts import decoder_layers
from clover_hf.core.quantized import check_readable
from clover_hf.decode.budget import DraftBudget
from clover_hf.decode.costs import CostModel
from clover_hf.decode.loop import INT8_DRAFT_IGNORED, GenerationStats, clover_generate
from clover_hf.heads.config import CloverConfig
from clover_hf.heads.base import DraftHeads
from clover_hf.heads.build import build_heads
from clover_hf.heads.clover import CloverHeads
from clover_hf.hub.card import write_model_card
from clover_hf.hub.repo import HEADS_FILES, is_heads_dir, load_heads, resolve_heads, save_heads

def check_supported(base_config: Any) -> None:
    """Raise ValueError for models that cannot verify a token tree in one forward."""
    cfg = base_config.get_text_config() if hasattr(base_config, "get_text_config") else base_config
    model_type = getattr(base_config, "model_type", "?")
    if getattr(base_config, "is_encoder_decoder", False):
        raise ValueError(f"Clover heads need a decoder-only causal LM; '{model_type}' is an encoder-decoder model.")
    why = architecture(base_config).unsupported
    if why is not None:
        raise ValueError(f"'{model_type}' {why}")
    if getattr(cfg, "alibi", False) or getattr(cfg, "position_embedding_type", "") == "alibi":
        raise ValueError(f"'{model_type}' {ALIBI}")
    odd = set(getattr(cfg, "layer_types", None) or []) - {"full_attention", "sliding_attention"}
    if odd:
        raise ValueError(f"'{model_type}' has layers of kinds {sorted(odd)}: {RECURRENT}")


def _length_dependent_rope(base_config: Any) -> tuple[str, int] | None:
    """(rope_type, limit) when the rotary frequencies change with the longest position in a forward
    (transformers' "dynamic" and "longrope" types) past `limit` positions; below it they are fixed,
    so a tree forward reaching ahead of the text rotates exactly as one-token decoding does."""
    cfg = base_config.get_text_config() if hasattr(base_config, "get_text_config") else base_config
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    for p in params.values() if all(isinstance(v, dict) for v in params.values()) and params else [params]:
        rope_type = str(p.get("rope_type", p.get("type", "")))
        if "dynamic" in rope_type or rope_type == "longrope":
            table = getattr(cfg, "max_position_embeddings", None)
            limit = p.get("original_max_position_embeddings") or table
            return rope_type, min(limit, table or limit)
    return None


def check_heads_match(config: CloverConfig, base_model: PreTrainedModel) -> None:
    """Raise ValueError when heads were built for a different base."""
    cfg = base_model.config.get_text_config()
    vocab = base_model.get_output_embeddings().weight.shape[0]
    if config.hidden_size != cfg.hidden_size:
        raise ValueError(f"heads have hidden_size {config.hidden_size} but the base model has {cfg.hidden_size}")
    if config.vocab_size != vocab:
        raise ValueError(f"heads have vocab_size {config.vocab_size} but the base model's lm_head has {vocab} rows")
    base_type = getattr(base_model.config, "model_type", None)
    if config.base_model_type and base_type and config.base_model_type != base_type:
        raise ValueError(
            f"heads were trained for a '{config.base_model_type}' model "
            f"({config.base_model_name_or_path}) but the base model is a '{base_type}'"
        )
    if config.feature_layers:
        layers = decoder_layers(base_model)
        count = 0 if layers is None else len(layers)
        resolved = {i % count for i in config.feature_layers if -count <= i < count} if count else set()
        if len(resolved) != len(config.feature_layers):
            raise ValueError(f"heads read the base's decoder layers {config.feature_layers} (feature_layers), but the "
                             f"base has {count} that clover-hf finds: these heads belong to another base")


class CloverForCausalLM(nn.Module):
    """A base causal LM with Clover draft heads. Attribute access falls through to the base (as PEFT does)."""

    def __init__(self, base_model: PreTrainedModel, heads: DraftHeads) -> None:
        super().__init__()
        check_supported(base_model.config)
        check_heads_match(heads.config, base_model)
        check_readable(base_model.get_output_embeddings().weight)  # the heads draft from its rows
        self.base_model = base_model
        self.clover_heads = heads
        self.generation_stats: GenerationStats | None = None
        # "auto": each step verifies what pays on this machine (see `generate`); "full": the whole tree
        self.budget: str | CostModel | DraftBudget = "auto"
        self._draft_budget = DraftBudget()  # what "auto" learns across calls: verify costs, acceptance
        if base_model.dtype == torch.bfloat16 and base_model.device.type == "cpu":
            cpu.prepare()  # built meanwhile, for the first call's verify forwards

    @property
    def clover_config(self) -> CloverConfig:
        return self.clover_heads.config

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in {"base_model", "clover_heads"}:
                raise
            return getattr(self.base_model, name)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_base(cls, base_model: PreTrainedModel, init_from_base: bool = True, init_norms_from_base: bool = False,
                  **config_kwargs: Any) -> "CloverForCausalLM":
        """Wrap a loaded base with freshly initialised heads (the starting point of training).

        `init_from_base` starts the Augmenting Block from the base's last decoder layer, and
        `init_norms_from_base` its final norm from the base's final norm (both as Clover-2 does);
        `config_kwargs` are `CloverConfig` fields. Medusa heads with `own_lm_heads` start their
        projections from the base's lm_head here, and again (`init_projections`) once a draft
        vocabulary is chosen.
        """
        check_supported(base_model.config)
        name = getattr(base_model.config, "_name_or_path", None) or None
        config_kwargs.setdefault("base_model_name_or_path", name)
        config = CloverConfig.for_base(base_model.config, **config_kwargs)
        heads = build_heads(config)
        heads.init_projections(base_model.get_output_embeddings())
        if init_from_base and isinstance(heads, CloverHeads) and not heads.init_from_base(base_model, init_norms_from_base):
            warnings.warn(f"nothing of {name or 'the base'}'s last decoder layer fits the Augmenting Block (no "
                          "matching names and shapes): it starts from random weights", stacklevel=2)
        heads.to(device=base_model.device, dtype=base_model.dtype)
        return cls(base_model, heads)

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | Path,
        base_model: str | Path | PreTrainedModel | None = None,
        clover_heads: str | Path | None = None,
        heads_revision: str | None = None,
        token: str | bool | None = None,
        cache_dir: str | Path | None = None,
        **base_kwargs: Any,
    ) -> "CloverForCausalLM":
        """Load heads and their base.

        `from_pretrained(heads)` loads the base named in the heads' config; `base_model=` overrides it
        with a path, repo id or loaded model. `from_pretrained(base, clover_heads=heads)` works too.
        `base_kwargs` (dtype, device_map, attn_implementation, revision, ...) go to the base's loader;
        `token`, `cache_dir`, `local_files_only` and `force_download` apply to the heads and the base.
        """
        if clover_heads is not None:
            if base_model is not None:
                raise ValueError("pass the base either as the first argument or as base_model=, not both")
            heads_ref, base_model = clover_heads, pretrained_model_name_or_path
            revision = heads_revision
        else:
            heads_ref = pretrained_model_name_or_path
            # A bare revision= belongs to the heads repo when the base comes from the heads' config.
            revision = heads_revision or (base_kwargs.pop("revision", None) if base_model is None else None)
        heads_dir = resolve_heads(heads_ref, revision=revision, token=token, cache_dir=cache_dir,
                                  local_files_only=base_kwargs.get("local_files_only", False),
                                  force_download=base_kwargs.get("force_download", False))
        if not is_heads_dir(heads_dir):
            raise ValueError(
                f"'{heads_ref}' holds no Clover heads config ({heads_dir}/config.json with model_type 'clover', "
                "Clover-2's with a 'clover' entry, or Medusa's with medusa_num_heads). To load a base model with heads use "
                "from_pretrained(base, clover_heads=heads)."
            )
        heads = load_heads(heads_dir)
        config = heads.config
        if base_model is None:
            if not config.base_model_name_or_path:
                raise ValueError(f"{heads_dir}/config.json names no base model; pass base_model=...")
            base_model = config.base_model_name_or_path
            base_kwargs.setdefault("revision", config.base_revision)
        if not isinstance(base_model, PreTrainedModel):
            if token is not None:
                base_kwargs.setdefault("token", token)
            if cache_dir is not None:
                base_kwargs.setdefault("cache_dir", cache_dir)
            base_model = AutoModelForCausalLM.from_pretrained(base_model, **base_kwargs)
        check_supported(base_model.config)
        return cls(base_model, heads.to(device=base_model.device, dtype=base_model.dtype))

    # -- saving ------------------------------------------------------------------------------
    def save_pretrained(
        self,
        save_directory: str | Path,
        metrics: dict[str, Any] | None = None,
        *,
        repo_id: str | None = None,
        license: str | None = None,
        datasets: list[str] | None = None,
        push_to_hub: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Write the heads only: config.json, model.safetensors and a README.md model card.

        The base is referenced, not copied. `metrics` (the trainer's `training_metrics.json` dict) fills
        the card's "Training and acceptance" section; `repo_id`, `license` and `datasets` go in the card.
        `push_to_hub=True` then uploads those three files to `repo_id` (default: the directory's name,
        created if needed), as in transformers; `token`, `private`, `commit_message`, `revision` and
        `create_pr` apply to the upload, whose commit info is returned.
        """
        if push_to_hub:
            api = HfApi(token=kwargs.get("token"))
            repo_id = api.create_repo(repo_id or Path(save_directory).name, private=kwargs.get("private"),
                                      exist_ok=True).repo_id
            revision, create_pr = kwargs.get("revision"), kwargs.get("create_pr", False)
            if revision is not None and not create_pr:
                api.create_branch(repo_id, branch=revision, exist_ok=True)
        directory = save_heads(self.clover_heads, save_directory, safe_serialization=kwargs.get("safe_serialization", True))
        write_model_card(directory, self.clover_config, metrics, license=license, datasets=datasets, repo_id=repo_id)
        if not push_to_hub:
            return None
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=directory,
            allow_patterns=HEADS_FILES,  # the heads' files only, whatever else the directory holds
            commit_message=kwargs.get("commit_message") or "Upload Clover heads",
            revision=revision,
            create_pr=create_pr,
        )

    def push_to_hub(
        self,
        repo_id: str,
        *,
        commit_message: str | None = None,
        private: bool | None = None,
        token: str | bool | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        metrics: dict[str, Any] | None = None,
        license: str | None = None,
        datasets: list[str] | None = None,
    ) -> Any:
        """Upload the heads and their model card to a Hub repo (created if needed); returns the commit info."""
        with tempfile.TemporaryDirectory() as tmp:
            return self.save_pretrained(tmp, metrics, repo_id=repo_id, license=license, datasets=datasets,
                                        push_to_hub=True, commit_message=commit_message, private=private,
                                        token=token, revision=revision, create_pr=create_pr)

    # -- running -----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.base_model(*args, **kwargs)

    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        *args: Any,
        tree: list[list[int]] | dict | None = None,
        lookup: int | None = None,
        lookup_max: int | None = None,
        int8_draft: bool | None = None,
        budget: str | CostModel | DraftBudget | None = None,
        calibrate: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """`generate` of the base, with greedy decoding and sampling run by Clover. Same arguments; the
        same output when greedy, the same distribution of outputs when sampling.

        `budget` (default: `model.budget`, "auto") chooses what each step verifies. "auto": the drafted
        nodes with the most expected tokens per second on this machine, from none (a plain decoding
        step, and no drafting while the heads do not pay) to the whole tree, from a cost model of the
        verify forward measured here and acceptance calibrated as decoding goes. "full": the whole
        tree every step, and "one-token": one token a step, no drafting (what speculation adds is
        Clover against this), both in the linear forms and weight copies "auto" multiplies with. A `CostModel` fixes the costs (nothing is
        measured). The first "auto" call on a new (base, dtype, device, threads, CPU) times how this
        machine multiplies (briefly, once) and learns the verify costs from its own first steps,
        each verifying one width it has no cost for yet; the costs are kept in the user cache
        ($CLOVER_HF_CACHE or ~/.cache/clover_hf). `calibrate=True` times every width again up front
        (a forward or two per width), `calibrate=False` never measures (without stored costs the whole tree is
        verified).

        `tree` overrides the heads' draft tree for this call (Medusa paths, or a dynamic tree as
        `{"depth": 4, "width": 4, "nodes": 16}`), `lookup` the length of the prompt-lookup chain
        verified with it (0: heads only) and `lookup_max` the length the chain doubles up to after a
        step that accepted all of it. `int8_draft` is deprecated and ignored (a FutureWarning says so).
        Modes Clover does not run yet fall back to the base's own `generate`, with a warning saying why.
        """
        if int8_draft is not None:
            warnings.warn(INT8_DRAFT_IGNORED, FutureWarning, stacklevel=2)
        if args:  # the base's positional arguments after generation_config (logits_processor, ...)
            kwargs.update(zip(list(inspect.signature(GenerationMixin.generate).parameters)[3:], args))
        draft_budget = self._resolve_budget(self.budget if budget is None else budget)
        config = self._resolved_config(generation_config, kwargs)
        reason = self._unsupported_reason(inputs, config, kwargs)
        if reason is not None:
            warnings.warn(f"Clover decoding does not support {reason}; using the base model's generate.", stacklevel=2)
            self.generation_stats = None
            kwargs = {k: v for k, v in kwargs.items() if not k.startswith("clover_")}
            return self.base_model.generate(inputs, generation_config, **kwargs)
        stats = GenerationStats()
        streamer = kwargs.pop("streamer", None)
        generation_config = self._move_stop_strings(config, generation_config, kwargs)
        out = self.base_model.generate(
            inputs,
            generation_config,
            streamer=streamer,
            custom_generate=clover_generate,
            clover_heads=self.clover_heads,
            clover_tree=tree,
            clover_lookup=lookup,
            clover_lookup_max=lookup_max,
            clover_budget=draft_budget,
            clover_calibrate=calibrate,
            clover_streamer=streamer,
            clover_stats=stats,
            **kwargs,
        )
        self.generation_stats = stats
        return out

    def _resolve_budget(self, budget: str | CostModel | DraftBudget) -> DraftBudget | None:
        if isinstance(budget, DraftBudget):
            return budget
        if isinstance(budget, CostModel):
            return DraftBudget(costs=budget)
        if budget == "auto":
            return self._draft_budget
        own = self.budget if isinstance(self.budget, DraftBudget) else self._draft_budget  # its forms and weight copies
        if budget == "full":
            return own.whole_tree()
        if budget == "one-token":
            return own.one_token()
        raise ValueError(f"budget must be 'auto', 'full', 'one-token', a CostModel or a DraftBudget, got {budget!r}")

    def _resolved_config(self, generation_config: GenerationConfig | None, kwargs: dict) -> GenerationConfig:
        """The config `generate` will run with: the call's config and keywords over the model's defaults."""
        options = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
        config, _ = self.base_model._prepare_generation_config(copy.deepcopy(generation_config), **options)
        return config

    def _move_stop_strings(self, config: GenerationConfig, generation_config: GenerationConfig | None,
                           kwargs: dict) -> GenerationConfig | None:
        """Turn stop strings into a stopping criterion here: `generate` does not hand `tokenizer` to
        custom decoders, so its own stop-string criterion could not be built. Returns the config to pass."""
        tokenizer = kwargs.pop("tokenizer", None)
        if not config.stop_strings:
            return generation_config
        if tokenizer is None:
            raise ValueError("stop_strings need the model's tokenizer: pass tokenizer=... to generate")
        criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
        criteria.append(StopStringCriteria(tokenizer, config.stop_strings))
        kwargs["stopping_criteria"] = criteria
        kwargs.pop("stop_strings", None)
        if generation_config is not None:
            generation_config = copy.deepcopy(generation_config)
            generation_config.stop_strings = None
        if generation_config is None or self.base_model.generation_config.stop_strings:
            kwargs["stop_strings"] = None  # a keyword wins over the model's default stop strings
        return generation_config

    def _unsupported_reason(self, inputs: Any, config: GenerationConfig, kwargs: dict) -> str | None:
        for key in ("assistant_model", "custom_generate", "inputs_embeds", "prefix_allowed_tokens_fn"):
            if kwargs.get(key) is not None:
                return f"`{key}`"
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        if ids is None:
            return "generation without input_ids"
        mode = config.get_generation_mode(kwargs.get("assistant_model"))
        if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
            return f"{mode.value.replace('_', ' ')} (greedy decoding and sampling only)"
        if getattr(config, "dola_layers", None) is not None:
            return "DoLa decoding"
        if config.guidance_scale is not None and config.guidance_scale != 1:
            return "classifier-free guidance (guidance_scale)"
        rows = (ids.shape[0] if ids.dim() == 2 else 1) * (config.num_return_sequences or 1)
        if rows > 1 and kwargs.get("streamer") is not None:
            return "streaming a batch"
        if rows > 1 and config.return_dict_in_generate and (config.output_scores or config.output_logits):
            return "output_scores / output_logits for a batch"
        early_stop = kwargs.get("stopping_criteria") or config.stop_strings or config.max_time  # config has the call's stop_strings
        if rows > 1 and config.eos_token_id is None and early_stop:
            # without an eos_token_id transformers keeps generating for rows that stopped, until all have
            return "a batch with stopping criteria but no eos_token_id"
        if config.return_dict_in_generate and (config.output_attentions or config.output_hidden_states):
            return "output_attentions / output_hidden_states"
        cache_reason = self._cache_reason(ids, config, kwargs)
        if cache_reason is not None:
            return cache_reason
        extra = sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in ("input_ids", "attention_mask"))
        if extra:
            return f"model inputs other than input_ids and attention_mask ({', '.join(extra)})"
        attention = getattr(self.base_model.config, "_attn_implementation", None)
        if attention not in (None, "eager", "sdpa"):
            return f"attn_implementation={attention!r}, which takes no tree-shaped attention mask (use 'sdpa' or 'eager')"
        rope = _length_dependent_rope(self.base_model.config)
        if rope is not None:
            max_length = ids.shape[-1] + config.max_new_tokens if config.max_new_tokens is not None else config.max_length
            if max_length > rope[1]:
                return (f"rope_type {rope[0]!r} past {rope[1]} positions, where its frequencies depend on the "
                        "furthest position in a forward")
        return None

    def _cache_reason(self, ids: torch.Tensor, config: GenerationConfig, kwargs: dict) -> str | None:
        """Why Clover cannot decode into the cache asked for (None: it can): a dynamic cache, a static one
        (`cache_implementation="static"`, or the caller's own empty `StaticCache` of room enough)."""
        cache = given_cache(kwargs)
        static = cache is not None or config.cache_implementation not in (None, "dynamic")
        if not static:
            return None
        if cache is None and config.cache_implementation != "static":
            return f"cache_implementation={config.cache_implementation!r} (Clover decodes on a dynamic or a static cache)"
        if cache is not None and not is_static(cache):
            return f"a {type(cache).__name__} passed in (Clover starts its own, or fills an empty StaticCache)"
        if cache is not None and cache.get_seq_length() != 0:
            return "a StaticCache that already holds tokens (Clover fills an empty one)"
        layout = MaskLayout.for_config(self.base_model.config)
        if layout.mapping or layout.sliding_window is not None or static_sliding_layers(cache):
            return ("a static cache with sliding-window attention layers: their static layers keep only the last "
                    "window of keys, and a tree's compaction moves keys that window has dropped")
        if cache is not None:
            length = ids.shape[-1] + config.max_new_tokens if config.max_new_tokens is not None else config.max_length
            if capacity(cache) < length:
                return f"a StaticCache of {capacity(cache)} slots for up to {length} tokens (make it larger)"
        return None


def register_with_pipelines() -> None:
    """Let transformers' text-generation pipeline take a CloverForCausalLM without logging that it is not
    supported. The pipeline checks the model's class name against MODEL_FOR_CAUSAL_LM_MAPPING_NAMES (and
    PEFT's classes) only, not against classes registered with AutoModelForCausalLM.register, so the name joins
    that table, under a model type ("clover") that no config maps to, so the auto classes never resolve it.
    Runs on import."""
    from transformers.models.auto import modeling_auto

    modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault("clover", CloverForCausalLM.__name__)


register_with_pipelines()
