"""Medusa heads as FasterDecoding publishes them (config.json with medusa_num_heads, medusa_lm_head.safetensors)
load from the Hub, use every tensor, draft what Medusa-1 defines, and decode exactly; the pickle is refused."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from huggingface_hub import create_repo, upload_folder
from safetensors.torch import save_file

from clover_hf import CloverForCausalLM, MedusaHeads
from clover_hf.hub.repo import load_heads

from .test_hub import BASE_REPO, forbid_pickle, push_base
from .tiny import prompt, tiny_model

pytestmark = pytest.mark.usefixtures("no_network")
MEDUSA_REPO = "org/tiny-medusa"


def medusa_checkpoint(directory, base, heads: int = 3, layers: int = 2, seed: int = 0, base_name: str = BASE_REPO,
                      dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """FasterDecoding's layout, with random blocks and projections near the base's lm_head."""
    g = torch.Generator().manual_seed(seed)
    H, V = base.config.hidden_size, base.config.vocab_size
    lm = base.get_output_embeddings().weight.detach()
    state = {}
    for k in range(heads):
        for j in range(layers):
            state[f"{k}.{j}.linear.weight"] = torch.randn(H, H, generator=g) * 0.05
            state[f"{k}.{j}.linear.bias"] = torch.randn(H, generator=g) * 0.05
        state[f"{k}.{layers}.weight"] = lm + torch.randn(V, H, generator=g) * 0.01
    state = {k: v.to(dtype) for k, v in state.items()}
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / "medusa_lm_head.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": base_name,
        "transformers_version": "4.33.0"}))
    return state


def test_medusa_repo_from_the_hub_decodes_exactly(hub_server, tmp_path):
    base = push_base()
    medusa_checkpoint(tmp_path / "medusa", base)
    create_repo(MEDUSA_REPO)
    upload_folder(repo_id=MEDUSA_REPO, folder_path=str(tmp_path / "medusa"))
    with pytest.MonkeyPatch.context() as patch:
        forbid_pickle(patch)
        clover = CloverForCausalLM.from_pretrained(MEDUSA_REPO)
    assert isinstance(clover.clover_heads, MedusaHeads)
    config = clover.clover_config
    assert (config.num_heads, config.medusa_num_layers, config.own_lm_heads, config.draft_vocab_size) == (3, 2, True, None)
    assert clover.base_model.config._name_or_path == BASE_REPO
    for seed in (1, 2):
        ids = prompt(seed)
        assert torch.equal(clover.generate(ids, max_new_tokens=30, do_sample=False, budget="full"),
                           base.generate(ids, max_new_tokens=30, do_sample=False))
    assert clover.generation_stats.tokens_per_step > 1.0  # the heads drafted and some drafts were kept


def test_medusa_checkpoint_drafts_what_medusa_1_defines(tmp_path):
    """Head k: x <- x + SiLU(W_kj x + b_kj) for each block j, then logits = P_k x, from the file's own tensors."""
    base = tiny_model("llama")
    state = medusa_checkpoint(tmp_path, base, heads=2, layers=2)
    heads = load_heads(tmp_path)
    assert {n for n, _ in heads.named_parameters()} == {
        *(f"heads.{k}.{j}.linear.{p}" for k in range(2) for j in range(2) for p in ("weight", "bias")),
        "lm_heads.0.weight", "lm_heads.1.weight"}
    h = torch.randn(5, base.config.hidden_size)
    rows = heads.draft_lm_head(base.get_output_embeddings())
    for k in range(2):
        x = h
        for j in range(2):
            x = x + F.silu(x @ state[f"{k}.{j}.linear.weight"].T + state[f"{k}.{j}.linear.bias"])
        want = x @ state[f"{k}.2.weight"].T
        with torch.no_grad():
            got = heads.head_logits(k, heads.heads[k](h), rows)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_pickle_only_medusa_repo_is_refused_with_how_to_convert(hub_server, tmp_path):
    base = push_base()
    medusa_checkpoint(tmp_path / "m", base)
    (tmp_path / "m" / "medusa_lm_head.safetensors").unlink()
    torch.save({"0.0.linear.weight": torch.zeros(2)}, tmp_path / "m" / "medusa_lm_head.pt")
    create_repo(MEDUSA_REPO)
    upload_folder(repo_id=MEDUSA_REPO, folder_path=str(tmp_path / "m"))
    with pytest.MonkeyPatch.context() as patch:
        forbid_pickle(patch)
        with pytest.raises(FileNotFoundError, match="medusa_lm_head.pt.*save_file"):
            CloverForCausalLM.from_pretrained(MEDUSA_REPO)
        with pytest.raises(FileNotFoundError, match="is there, a pickle, which clover-hf never loads"):
            load_heads(tmp_path / "m")  # a local copy that has the pickle says so
    assert not any(p.endswith(".pt") for _, p in hub_server.requests if "/resolve/" in p)


def _vllm_medusa_proposals(directory, hidden: torch.Tensor) -> torch.Tensor:
    """Top-1 proposals per head as vLLM's Medusa draft model computes them from these files (its names and
    its config's renaming: keys with 'num' and 'heads' / 'layers' become num_heads / num_hidden_layers)."""
    from safetensors.torch import load_file

    config = json.loads((directory / "config.json").read_text())
    for key in list(config):
        if "num" in key and "heads" in key:
            config["num_heads"] = config.pop(key)
        elif "num" in key and "layers" in key:
            config["num_hidden_layers"] = config.pop(key)
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    weights = load_file(str(directory / "model.safetensors"))
    token_map = weights.get("token_map")
    assert (config["truncated_vocab_size"] == config["vocab_size"]) or token_map is not None
    proposals = []
    for k in range(config["num_heads"]):
        x = hidden
        for j in range(config["num_hidden_layers"]):
            bias = weights[f"blocks.{k}.layers.{j}.bias"] if config.get("medusa_fc_bias", False) else None
            x = x + F.silu(F.linear(x, weights[f"blocks.{k}.layers.{j}.weight"], bias))
        logits = x @ weights[f"lm_heads.{k}.weight"].T
        if token_map is not None:
            full = torch.full((*logits.shape[:-1], config["vocab_size"]), -torch.inf)
            full[..., token_map] = logits
            logits = full
        proposals.append(logits.argmax(-1))
    return torch.stack(proposals)


@pytest.mark.parametrize("own_lm_heads", [True, False])
def test_medusa_heads_export_to_vllms_layout(tmp_path, own_lm_heads):
    from clover_hf.tools.cli import main as cli_main

    from .tiny import random_heads

    base = tiny_model("llama")
    base_dir = tmp_path / "base"
    base.save_pretrained(base_dir)
    clover = random_heads(base, seed=5, head_type="medusa", own_lm_heads=own_lm_heads, medusa_num_layers=2,
                          draft_vocab_size=96, base_model_name_or_path=str(base_dir))[0]
    heads = clover.clover_heads
    heads.draft_token_ids.copy_(torch.randperm(256)[:96].sort().values)
    if own_lm_heads:
        heads.init_projections(base.get_output_embeddings())
        with torch.no_grad():
            for p in heads.lm_heads:
                p.weight.add_(torch.randn_like(p.weight) * 0.05)
    clover.save_pretrained(tmp_path / "heads")
    assert cli_main(["export", str(tmp_path / "heads"), str(tmp_path / "vllm"), "--format", "vllm-medusa"]) == 0
    hidden = torch.randn(6, 64)
    rows = heads.draft_lm_head(base.get_output_embeddings())
    with torch.no_grad():
        ours = torch.stack([heads.draft_token_ids[heads.head_logits(k, heads.heads[k](hidden), rows).argmax(-1)]
                            for k in range(heads.config.num_heads)])
    assert torch.equal(_vllm_medusa_proposals(tmp_path / "vllm", hidden), ours)


def test_only_medusa_heads_export_to_vllm(tmp_path):
    from clover_hf.hub.formats import export_vllm_medusa

    from .tiny import random_heads

    clover = random_heads(tiny_model("llama"), seed=1)[0]
    with pytest.raises(ValueError, match="these are clover heads.*README"):
        export_vllm_medusa(clover.clover_heads, tmp_path)
    medusa = random_heads(tiny_model("llama"), seed=1, head_type="medusa")[0]
    with pytest.raises(ValueError, match="--base-model"):
        export_vllm_medusa(medusa.clover_heads, tmp_path)


CLOVER2_REPO = "org/tiny-clover2"


def clover2_checkpoint(directory, base, heads: int = 3, layers: int = 2, seed: int = 0, lm_copies: bool = True,
                       dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Clover-2's layout (its clover2.py / main_clover2.py): the draft's Llama config with a "clover" entry, and
    model.safetensors with its module names, random weights, and (`lm_copies`) its frozen copies of the base's
    lm_head."""
    from clover_hf.hub.formats import CLOVER2_LAYER_NAMES, CLOVER2_NAMES

    g = torch.Generator().manual_seed(seed)
    cfg = base.config
    H, I, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    shapes = {"q_proj.weight": (H, H), "k_proj.weight": (kv, H), "v_proj.weight": (kv, H), "o_proj.weight": (H, H),
              "gate_proj.weight": (I, H), "up_proj.weight": (I, H), "down_proj.weight": (H, I)}
    state = {}
    for theirs in CLOVER2_NAMES:
        if theirs.endswith("norm.weight"):
            state[theirs] = 1 + 0.1 * torch.randn(H, generator=g)
        elif theirs.startswith("clover_head_mlp2.weight"):
            state[theirs] = torch.randn(H, 2 * H, generator=g) / (2 * H) ** 0.5
        elif theirs.endswith(".weight"):
            state[theirs] = torch.randn(H, H, generator=g) / H**0.5
        else:
            state[theirs] = 0.1 * torch.randn(H, generator=g)
    for i in range(layers):
        for theirs in CLOVER2_LAYER_NAMES:
            shape = (H,) if "layernorm" in theirs else shapes[theirs.split(".", 1)[1]]
            scale = 0.1 if "layernorm" in theirs else shape[-1] ** -0.5
            state[f"layers.{i}.{theirs}"] = (1 if "layernorm" in theirs else 0) + scale * torch.randn(*shape, generator=g)
    if lm_copies:
        lm = base.get_output_embeddings().weight.detach().clone()
        state["lm_head.weight"], state["clover_embed_tokens.weight"] = lm, lm.clone()
    state = {k: v.to(dtype) for k, v in state.items()}
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / "model.safetensors"))
    config = {k: v for k, v in cfg.to_dict().items() if k != "_name_or_path"}
    config.update(num_hidden_layers=1, clover={"num_heads": heads, "num_layers": layers, "heads_coefficient": 1.0,
                                               "decay_coefficient": 0.7})
    (directory / "config.json").write_text(json.dumps(config))
    return state


def _clover2_reference(state, base, ids: torch.Tensor, heads: int) -> list[torch.Tensor]:
    """Clover-2's teacher-forced logits per head, computed with transformers' own Llama layers from the file's
    tensors: Attention Decoder on the base's states before its final norm and the next token's lm_head row,
    the decoder layers (causal), norm; head 0 norm(W0 x), head i norm(W [x_i; e]) after the shared decoder."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

    from clover_hf.base.parts import norm_inputs

    cfg = base.config
    with torch.no_grad(), norm_inputs(base) as captured:
        base(ids)
    h = captured[-1][0]  # (T, H) before the final norm
    lm = state["lm_head.weight"]
    emb = lm[ids[0]]  # Clover-2 embeds with the lm_head's rows
    nh = cfg.num_attention_heads

    def rms(x, w):
        norm = LlamaRMSNorm(x.shape[-1], eps=cfg.rms_norm_eps)
        norm.weight.data = w
        return norm(x)

    def decoder(x, y, name):
        q = F.linear(rms(x, state[f"{name}.input_layernorm.weight"]), state[f"{name}.q.weight"], state[f"{name}.q.bias"])
        k = F.linear(y, state[f"{name}.k.weight"], state[f"{name}.k.bias"])
        v = F.linear(y, state[f"{name}.v.weight"], state[f"{name}.v.bias"])
        gate = F.cosine_similarity(q.view(*q.shape[:-1], nh, -1), k.view(*k.shape[:-1], nh, -1), dim=-1)
        return x + (v.view(*v.shape[:-1], nh, -1) * gate[..., None]).flatten(-2)

    with torch.no_grad():
        x = decoder(h[:-1], emb[1:], "clover_head_mlp_rnn")[None]  # (1, T-1, H)
        T = x.shape[1]
        positions = torch.arange(T)[None]
        rope = LlamaRotaryEmbedding(cfg)(x, positions)
        mask = torch.full((T, T), torch.finfo(x.dtype).min).triu(1)[None, None]
        for i in range(2):
            layer = LlamaDecoderLayer(cfg, layer_idx=i)
            layer.load_state_dict({k.split(".", 2)[2]: v for k, v in state.items() if k.startswith(f"layers.{i}.")})
            x = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)
            x = x[0] if isinstance(x, tuple) else x
        x = rms(x, state["clover_norm.weight"])[0]
        out = []
        for i in range(heads):
            L = T - i
            e = emb[1 + i : 1 + i + L]
            if i == 0:
                y = F.linear(x[:L], state["clover_head_mlp.weight"], state["clover_head_mlp.bias"])
            else:
                x = decoder(x[:L], e, "clover_head_mlp_rnn2")
                y = F.linear(torch.cat([x, e], -1), state["clover_head_mlp2.weight"], state["clover_head_mlp2.bias"])
            out.append(rms(y, state["clover_head_norm.weight"]) @ lm.T)
    return out


def test_clover2_checkpoint_uses_every_tensor_and_drafts_as_clover2_defines(tmp_path):
    base = tiny_model("llama")
    base.config._attn_implementation = "eager"
    state = clover2_checkpoint(tmp_path, base)
    heads = load_heads(tmp_path)
    config = heads.config
    assert (config.head_input, config.decoder_bias, config.embed_from_lm_head, config.output_head) == \
        ("pre_norm", True, True, "linear")
    assert config.num_augment_layers == 2 and config.num_heads == 3 and config.draft_vocab_size is None
    # every tensor of the file but the base's lm_head copies went into the heads, each unchanged
    ours = heads.state_dict()
    from clover_hf.hub.formats import CLOVER2_BASE_COPIES

    used = [k for k in state if k not in CLOVER2_BASE_COPIES]
    assert len(used) == len(ours) and sorted(v.sum().item() for v in ours.values()) == \
        pytest.approx(sorted(state[k].sum().item() for k in used))
    ids = prompt(4, 12)
    want = _clover2_reference(state, base, ids, heads=3)
    from clover_hf.base.parts import norm_inputs

    with torch.no_grad(), norm_inputs(base) as captured:
        base(ids)
        embed = heads.token_embedding(base)
        got = heads(captured[-1][:, :-1], embed(ids[:, 1:]))
    for i, (g, w) in enumerate(zip(got, want)):
        rows = heads.draft_lm_head(base.get_output_embeddings())
        torch.testing.assert_close(rows(g[0]), w[: g.shape[1]], rtol=1e-4, atol=1e-4, msg=f"head {i}")


def test_clover2_repo_from_the_hub_decodes_exactly(hub_server, tmp_path):
    base = push_base()
    clover2_checkpoint(tmp_path / "c2", base)
    create_repo(CLOVER2_REPO)
    upload_folder(repo_id=CLOVER2_REPO, folder_path=str(tmp_path / "c2"))
    with pytest.raises(ValueError, match="names no base model"):
        CloverForCausalLM.from_pretrained(CLOVER2_REPO)
    with pytest.MonkeyPatch.context() as patch:
        forbid_pickle(patch)
        clover = CloverForCausalLM.from_pretrained(CLOVER2_REPO, base_model=BASE_REPO)
    for seed in (1, 2):
        ids = prompt(seed)
        want = base.generate(ids, max_new_tokens=30, do_sample=False)
        for budget in ("full", "auto"):
            assert torch.equal(clover.generate(ids, max_new_tokens=30, do_sample=False, budget=budget), want)


@pytest.mark.parametrize("layout, change, words", [
    ("medusa", lambda s: s.update({"3.0.linear.weight": s["0.0.linear.weight"].clone()}), "extra \\['3.0.linear.weight'\\]"),
    ("medusa", lambda s: s.pop("1.2.weight"), "missing \\['1.2.weight'\\]"),
    ("clover2", lambda s: s.pop("clover_head_mlp2.bias"), "missing \\['clover_head_mlp2.bias'\\]"),
    ("clover2", lambda s: s.update({"layers.2.mlp.up_proj.weight": s["layers.0.mlp.up_proj.weight"].clone()}),
     "extra \\['layers.2.mlp.up_proj.weight'\\]"),
])
def test_a_file_that_does_not_fit_its_layout_is_refused_naming_the_keys(tmp_path, layout, change, words):
    build, name = {"medusa": (medusa_checkpoint, "medusa_lm_head.safetensors"),
                   "clover2": (clover2_checkpoint, "model.safetensors")}[layout]
    state = build(tmp_path, tiny_model("llama"))
    change(state)
    save_file(state, str(tmp_path / name))
    with pytest.raises(ValueError, match=words):
        load_heads(tmp_path)
