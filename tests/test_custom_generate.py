"""Clover through transformers' own `generate(custom_generate=...)`: the exported repo served by the loopback
Hub, loaded by transformers, decoding with heads from the Hub; output identical to plain `generate` (fp32)."""

from __future__ import annotations

import pytest
import torch
from huggingface_hub import list_repo_files

from clover_hf import CloverForCausalLM
from clover_hf.custom_generate import export_generate
from clover_hf.tools.cli import main as cli_main

from .test_hub import HEADS_REPO, heads_for, push_base
from .tiny import prompt, tiny_model

pytestmark = pytest.mark.usefixtures("no_network")
GENERATE_REPO = "org/clover"


@pytest.fixture
def clover_runs(monkeypatch):
    """Counts the calls that Clover decodes (so a silent fall-back to plain decoding would show)."""
    calls = []
    real = CloverForCausalLM.generate

    def spy(self, *args, **kwargs):
        calls.append(kwargs)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CloverForCausalLM, "generate", spy)
    return calls


def test_custom_generate_repo_from_the_hub_decodes_exactly(hub_server, tmp_path, clover_runs):
    base = push_base()
    heads_for(base, seed=1).push_to_hub(HEADS_REPO)
    assert cli_main(["export-generate", str(tmp_path / "repo"), "--push-to-hub", GENERATE_REPO]) == 0
    assert sorted(list_repo_files(GENERATE_REPO)) == [".gitattributes", "README.md", "custom_generate/generate.py",
                                                       "custom_generate/requirements.txt"]
    ids = prompt(3)
    expected = base.generate(ids, max_new_tokens=30, do_sample=False)
    for budget in ("full", None):  # the whole tree, then the heads' default budget
        extra = {} if budget is None else {"budget": budget}
        out = base.generate(ids, max_new_tokens=30, do_sample=False, custom_generate=GENERATE_REPO,
                            trust_remote_code=True, clover_heads=HEADS_REPO, **extra)
        assert torch.equal(out, expected)
    assert len(clover_runs) == 2 and clover_runs[0]["budget"] == "full"
    # a batch, left-padded, with an attention mask: the base's arguments pass through
    ids2 = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt(4, 7)], 1)
    batch = torch.cat([prompt(5), ids2])
    mask = (torch.arange(10) >= torch.tensor([[0], [3]])).long()
    want = base.generate(batch, attention_mask=mask, max_new_tokens=20, do_sample=False)
    got = base.generate(batch, attention_mask=mask, max_new_tokens=20, do_sample=False,
                        custom_generate=GENERATE_REPO, trust_remote_code=True, clover_heads=HEADS_REPO)
    assert torch.equal(got, want)


def test_custom_generate_from_a_directory_and_its_errors(hub_server, tmp_path, clover_runs):
    """(hub_server keeps transformers' copy of the repo's code in a temporary modules cache.)"""
    base = tiny_model("qwen2")
    heads = tmp_path / "heads"
    clover = CloverForCausalLM.from_base(base)
    clover.save_pretrained(heads)
    repo = export_generate(tmp_path / "repo")
    text = (repo / "README.md").read_text()
    assert text.startswith("---\nlibrary_name: transformers\ntags:\n- custom_generate")
    assert (repo / "custom_generate" / "requirements.txt").read_text().startswith("clover-hf>=")
    ids = prompt(6)
    expected = base.generate(ids, max_new_tokens=25, do_sample=False)
    out = base.generate(ids, max_new_tokens=25, do_sample=False, custom_generate=str(repo), trust_remote_code=True,
                        clover_heads=str(heads), lookup=3)
    assert torch.equal(out, expected) and clover_runs[-1]["lookup"] == 3
    with pytest.raises(ValueError, match="clover_heads="):
        base.generate(ids, max_new_tokens=5, custom_generate=str(repo), trust_remote_code=True)
    with pytest.raises(ValueError, match="trust_remote_code"):
        base.generate(ids, max_new_tokens=5, custom_generate=str(repo), clover_heads=str(heads))
