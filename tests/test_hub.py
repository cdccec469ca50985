"""Heads on the Hub, through the real huggingface_hub / transformers clients and the fake Hub server:
push and load by name, pinned revisions, private repos, the model card, offline mode, safe loading."""

from __future__ import annotations

import pickle
import traceback
from importlib import resources
from pathlib import Path

import pytest
import tomllib
import torch
from huggingface_hub import ModelCard, create_repo, list_repo_files, model_info, upload_folder
from safetensors.torch import save_file

from clover_hf import CloverConfig, CloverForCausalLM, CloverHeads
from clover_hf.hub.card import NO_FIGURES, render_model_card
from clover_hf.hub.repo import save_heads

from .conftest_hub import set_hf_offline
from .tiny import prompt, tiny_model

pytestmark = pytest.mark.usefixtures("no_network")


@pytest.fixture(autouse=True)
def one_thread():
    """The models here are tiny: a second intra-op thread only adds waiting (100x on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

ROOT = Path(__file__).resolve().parents[1]
BASE_REPO, HEADS_REPO = "org/tiny-base", "org/tiny-heads"
HEADS_FILES = [".gitattributes", "README.md", "config.json", "model.safetensors"]
# The shape of the trainer's training_metrics.json (clover_hf/pipeline.py).
METRICS = {
    "training": {"sequences": 1200, "tokens": 345678, "steps": 500, "batch_size": 8, "self_distill": True,
                 "data": ["sharegpt"], "prepare_seconds": 300, "total_seconds": 1500, "processes": 2},
    "eval": [{"top1": 0.612, "top5": 0.853, "loss": 1.9}, {"top1": 0.401, "top5": 0.664, "loss": 2.8},
             {"top1": 0.25, "top5": 0.5, "loss": 3.3}, {"top1": 0.125, "top5": 0.375, "loss": 3.9}],
    "data_config": {"base_model": BASE_REPO, "data": ["sharegpt"], "max_length": 512, "base_dtype": "float32"},
    "train_config": {"lr": 1e-3, "max_steps": 500, "batch_size": 8},
    "benchmark": {"tokens_per_step": 2.37, "speedup": 1.61, "prompts": "MT-Bench, 80 questions"},
}


def push_base():
    """A tiny base pushed with transformers' own push_to_hub; returns the in-memory model."""
    base = tiny_model("llama")
    base.push_to_hub(BASE_REPO)
    return base


def heads_for(base, seed: int) -> CloverForCausalLM:
    """Heads naming the Hub base, with random weights (so two seeds give two different checkpoints)."""
    torch.manual_seed(seed)
    clover = CloverForCausalLM.from_base(base, base_model_name_or_path=BASE_REPO)
    with torch.no_grad():
        for p in clover.clover_heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return clover


def assert_same_heads(a: CloverForCausalLM, b: CloverForCausalLM) -> None:
    sa, sb = a.clover_heads.state_dict(), b.clover_heads.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def generate(model, ids) -> torch.Tensor:
    if isinstance(model, CloverForCausalLM):  # the whole tree: equal heads then take equal steps, whatever the clock
        return model.generate(ids, max_new_tokens=24, do_sample=False, budget="full")
    return model.generate(ids, max_new_tokens=24, do_sample=False)


def forbid_pickle(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("loading Clover heads must not unpickle anything")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)


def test_push_then_load_by_name_generates_the_same(hub_server):
    base = push_base()
    clover = heads_for(base, seed=0)
    ids = prompt(2)
    expected = generate(clover, ids)
    assert torch.equal(expected, generate(base, ids))

    clover.push_to_hub(HEADS_REPO)
    assert sorted(list_repo_files(HEADS_REPO)) == HEADS_FILES  # nothing of the base
    # Loading resolves the base from the heads' config, runs no remote code and unpickles nothing.
    import transformers.dynamic_module_utils as dynamic

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dynamic, "get_class_from_dynamic_module", lambda *a, **k: pytest.fail("remote code"))
        forbid_pickle(patch)
        loaded = CloverForCausalLM.from_pretrained(HEADS_REPO)

    assert loaded.base_model.config._name_or_path == BASE_REPO
    for name, tensor in base.state_dict().items():
        assert torch.equal(loaded.base_model.state_dict()[name], tensor), name
    assert_same_heads(loaded, clover)
    assert torch.equal(generate(loaded, ids), expected)
    assert loaded.generation_stats.tokens_per_step == pytest.approx(clover.generation_stats.tokens_per_step)
    # Only the heads' own files were fetched from the heads repo.
    fetched = {p.rsplit("/", 1)[-1] for m, p in hub_server.requests if p.startswith(f"/{HEADS_REPO}/resolve/")}
    assert fetched <= {"README.md", "config.json", "model.safetensors"}


def test_revisions_pin_the_heads(hub_server):
    base = push_base()
    old, new = heads_for(base, seed=1), heads_for(base, seed=2)
    first = old.push_to_hub(HEADS_REPO)
    second = new.push_to_hub(HEADS_REPO, commit_message="retrained")
    assert first.oid != second.oid and model_info(HEADS_REPO).sha == second.oid

    assert_same_heads(CloverForCausalLM.from_pretrained(HEADS_REPO), new)
    assert_same_heads(CloverForCausalLM.from_pretrained(HEADS_REPO, heads_revision=first.oid), old)
    # With the base taken from the heads' config, a bare revision= pins the heads repo.
    assert_same_heads(CloverForCausalLM.from_pretrained(HEADS_REPO, revision=first.oid), old)
    # Base first, heads second: revision= would belong to the base, heads_revision= to the heads.
    assert_same_heads(CloverForCausalLM.from_pretrained(BASE_REPO, clover_heads=HEADS_REPO, heads_revision=first.oid), old)
    with pytest.raises(OSError, match="revision 'no-such-branch' does not exist"):
        CloverForCausalLM.from_pretrained(HEADS_REPO, revision="no-such-branch")


def test_private_heads_need_a_token(hub_server):
    base = push_base()
    clover = heads_for(base, seed=3)
    clover.push_to_hub(HEADS_REPO, private=True)
    assert model_info(HEADS_REPO).private is True

    with pytest.raises(OSError) as err:
        CloverForCausalLM.from_pretrained(HEADS_REPO, token=False)
    assert type(err.value) is OSError  # ours, with a message, not the HTTP error
    assert HEADS_REPO in str(err.value) and "token=" in str(err.value) and "private" in str(err.value)
    assert_same_heads(CloverForCausalLM.from_pretrained(HEADS_REPO, token=hub_server.token), clover)


def test_model_card_on_the_hub(hub_server, tmp_path):
    base = push_base()
    clover = heads_for(base, seed=4)
    clover.push_to_hub(HEADS_REPO, metrics=METRICS, license="apache-2.0")
    assert ("POST", "/api/validate-yaml") in hub_server.requests  # the Hub client checked the front matter

    card = ModelCard.load(HEADS_REPO)  # downloads README.md and parses its YAML front matter
    assert card.data.base_model == BASE_REPO
    assert card.data.library_name == "clover-hf"
    assert {"clover", "speculative-decoding", "llama"} <= set(card.data.tags)
    assert card.data.license == "apache-2.0" and card.data.pipeline_tag == "text-generation"
    assert card.data.datasets == ["anon8231489123/ShareGPT_Vicuna_unfiltered"]  # from the metrics' data
    text = card.text
    assert f'CloverForCausalLM.from_pretrained("{HEADS_REPO}")' in text
    assert "| 0 | t+2 | 61.2% | 85.3% | 1.900 |" in text and "| 1 | t+3 | 40.1% | 66.4% | 2.800 |" in text
    assert "2.37" in text and "1.61x" in text and "500 optimizer steps of 8 sequences" in text
    assert "1,200 sequences, 345,678 tokens" in text and "25 min 00 s" in text
    assert NO_FIGURES not in text

    # Without metrics the card says that no figures were recorded, and invents none.
    clover.push_to_hub("org/untrained-heads")
    bare = ModelCard.load("org/untrained-heads")
    assert bare.data.base_model == BASE_REPO and bare.data.license is None and bare.data.datasets is None
    section = bare.text.split("## Training and acceptance", 1)[1]
    assert section.strip() == NO_FIGURES

    # save_pretrained writes the same card locally, next to the heads.
    clover.save_pretrained(tmp_path / "heads", METRICS)
    local = ModelCard.load(tmp_path / "heads" / "README.md")
    assert local.data.base_model == BASE_REPO and "61.2%" in local.text


def test_offline_uses_the_cache_and_says_so(hub_server, monkeypatch):
    base = push_base()
    clover = heads_for(base, seed=5)
    pushed = clover.push_to_hub(HEADS_REPO)
    clover.push_to_hub("org/never-downloaded")
    ids = prompt(4)
    expected = generate(clover, ids)
    CloverForCausalLM.from_pretrained(HEADS_REPO)  # fills the cache (heads and base)

    set_hf_offline(monkeypatch)
    before = len(hub_server.requests)
    for loaded in (CloverForCausalLM.from_pretrained(HEADS_REPO),
                   CloverForCausalLM.from_pretrained(HEADS_REPO, revision=pushed.oid)):
        assert_same_heads(loaded, clover)
        assert torch.equal(generate(loaded, ids), expected)

    with pytest.raises(OSError) as err:
        CloverForCausalLM.from_pretrained("org/never-downloaded")
    message = str(err.value)
    assert "not in the local cache" in message and "HF_HUB_OFFLINE" in message and "org/never-downloaded" in message
    assert type(err.value) is OSError and err.value.__cause__ is None and err.value.__suppress_context__
    shown = "".join(traceback.format_exception(err.value))
    assert "huggingface_hub" not in shown and "httpx" not in shown  # no HTTP-layer traceback
    assert len(hub_server.requests) == before  # nothing reached the server


def test_pickle_only_repo_is_refused_without_unpickling(hub_server, tmp_path, monkeypatch):
    base = tiny_model("llama")
    heads = CloverHeads(CloverConfig.for_base(base.config, base_model_name_or_path=BASE_REPO))
    folder = tmp_path / "pickled"
    folder.mkdir()
    heads.config.save(folder)
    torch.save(heads.state_dict(), folder / "pytorch_model.bin")
    create_repo("org/pickled")
    upload_folder(repo_id="org/pickled", folder_path=folder)

    forbid_pickle(monkeypatch)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        CloverForCausalLM.from_pretrained("org/pickled", base_model=base)
    assert not any(p.endswith("pytorch_model.bin") for _, p in hub_server.requests if "/resolve/" in p)


@pytest.mark.parametrize("defect, words", [("shape", "shape"), ("dtype", "dtype")])
def test_weights_that_disagree_with_the_config_are_refused(hub_server, tmp_path, defect, words):
    base = tiny_model("llama")
    config = CloverConfig.for_base(base.config, base_model_name_or_path=BASE_REPO)
    folder = save_heads(CloverHeads(config), tmp_path / "bad")
    if defect == "shape":  # weights of heads with a smaller MLP under the config of the default ones
        other = CloverHeads(CloverConfig.for_base(base.config, intermediate_size=32))
        state = {k: v.contiguous() for k, v in other.state_dict().items()}
    else:  # the right names and shapes, integer tensors
        state = {k: torch.zeros(v.shape, dtype=torch.int32) for k, v in CloverHeads(config).state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    create_repo("org/bad-heads")
    upload_folder(repo_id="org/bad-heads", folder_path=folder)
    with pytest.raises(ValueError, match=words) as err:
        CloverForCausalLM.from_pretrained("org/bad-heads", base_model=base)
    assert "model.safetensors" in str(err.value)


def test_remote_code_is_never_fetched(hub_server, tmp_path):
    """A heads repo asking for custom code: its config is refused as data, and the .py never downloaded."""
    base = tiny_model("llama")
    folder = save_heads(CloverHeads(CloverConfig.for_base(base.config)), tmp_path / "remote")
    config = (folder / "config.json").read_text().replace('"model_type"', '"auto_map": {"AutoModel": "x.Y"}, "model_type"')
    (folder / "config.json").write_text(config)
    (folder / "x.py").write_text("raise SystemExit('remote code ran')\n")
    create_repo("org/remote-code")
    upload_folder(repo_id="org/remote-code", folder_path=folder)
    with pytest.raises(ValueError, match="auto_map"):
        CloverForCausalLM.from_pretrained("org/remote-code", base_model=base)
    assert not any(p.endswith(".py") for _, p in hub_server.requests if "/resolve/" in p)


def test_card_template_ships_with_the_package():
    template = resources.files("clover_hf").joinpath("MODEL_CARD.md")
    assert template.is_file()
    assert (ROOT / "MODEL_CARD.md").is_symlink() and (ROOT / "MODEL_CARD.md").resolve() == Path(str(template)).resolve()
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "MODEL_CARD.md" in package_data["clover_hf"]


def test_card_for_a_local_base_names_no_hub_model(tmp_path):
    base_dir = tmp_path / "my-base"
    base_dir.mkdir()
    config = CloverConfig(hidden_size=16, vocab_size=32, num_attention_heads=2, base_model_name_or_path=str(base_dir))
    text = render_model_card(config)
    front = text.split("---")[1]
    assert "base_model:" not in front and "library_name: clover-hf" in front
    assert 'base_model="path/to/the/base-model"' in text  # the usage example says to pass the base
    assert text.rstrip().endswith(NO_FIGURES)
    # A local conversion of a Hub model (clover_hf.embedded) is published under its source's id.
    (base_dir / "clover_hf_conversion.json").write_text('{"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct"}')
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in render_model_card(config).split("---")[1]


def test_a_missing_local_directory_is_not_sent_to_the_hub(tmp_path):
    with pytest.raises(OSError, match="neither a local directory nor a valid Hub repo id"):
        CloverForCausalLM.from_pretrained(str(tmp_path / "no" / "such-heads"))


def test_push_to_a_new_branch_and_load_it(hub_server):
    base = push_base()
    main, branch = heads_for(base, seed=4), heads_for(base, seed=5)
    main.push_to_hub(HEADS_REPO)
    branch.push_to_hub(HEADS_REPO, revision="v2")  # the branch does not exist yet
    assert_same_heads(CloverForCausalLM.from_pretrained(HEADS_REPO), main)
    assert_same_heads(CloverForCausalLM.from_pretrained(HEADS_REPO, heads_revision="v2"), branch)


def test_save_pretrained_can_push(hub_server, tmp_path):
    base = push_base()
    clover = heads_for(base, seed=6)
    clover.save_pretrained(tmp_path / "tiny-heads", push_to_hub=True, repo_id=HEADS_REPO)
    assert sorted(list_repo_files(HEADS_REPO)) == HEADS_FILES
    assert_same_heads(CloverForCausalLM.from_pretrained(HEADS_REPO), clover)


def test_a_base_repo_as_heads_is_refused_before_its_weights_download(hub_server):
    push_base()
    before = len(hub_server.requests)
    with pytest.raises(ValueError, match="holds no Clover heads config.*clover_heads=heads"):
        CloverForCausalLM.from_pretrained(BASE_REPO)
    fetched = {p.rsplit("/", 1)[-1] for m, p in list(hub_server.requests)[before:] if p.startswith(f"/{BASE_REPO}/resolve/")}
    assert fetched == {"config.json"}
