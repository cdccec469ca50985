"""Every ```python block in README.md runs as written.

Each block runs in this process, in a fresh namespace and a fresh working directory, in the order of
the README. The embedded SmolLM2-135M-Instruct is converted once per test session (CLOVER_HF_TEST_CACHE
reuses a conversion) and put where `load_default()` finds it.

A block whose first line is `# needs: hub` runs against the local test Hub (tests/hub_server.py), which
then holds what such blocks name: the embedded base as `HuggingFaceTB/SmolLM2-135M-Instruct`, the
shipped heads, whose config names that base, as `your-name/SmolLM2-135M-Instruct-clover`, and heads for
that base in the layouts of Medusa (FasterDecoding's) and Clover-2, with random weights, as
`your-name/SmolLM2-135M-Instruct-medusa` and `your-name/clover-2-SmolLM2-135M-Instruct`. No block may
reach the network.
"""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
from huggingface_hub import create_repo, upload_folder

from clover_hf.cpu.dtype import default_dtype
from clover_hf.embedded import DEFAULT_BASE_NAME, MARKER_FILE, base_model_path, default_cache_dir, shipped_heads_path
from clover_hf.hub.repo import HEADS_FILES

from .hub_server import HubServer

README = Path(__file__).resolve().parents[1] / "README.md"
HUB_MARK = "# needs: hub"
HEADS_REPO = "your-name/SmolLM2-135M-Instruct-clover"  # the heads repo the README's Hub blocks name
MEDUSA_REPO, CLOVER2_REPO = "your-name/SmolLM2-135M-Instruct-medusa", "your-name/clover-2-SmolLM2-135M-Instruct"


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line of the first code line, code) of every ```python block."""
    blocks = []
    for match in re.finditer(r"^```python[ \t]*\n(.*?)^```[ \t]*$", text, flags=re.MULTILINE | re.DOTALL):
        blocks.append((text.count("\n", 0, match.start(1)) + 1, match.group(1)))
    return blocks


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def needs_hub(code: str) -> bool:
    return code.lstrip().startswith(HUB_MARK)


def test_readme_has_an_offline_quickstart_and_hub_blocks():
    assert BLOCKS, "README.md has no ```python blocks"
    assert not needs_hub(BLOCKS[0][1]), "the first block (the quickstart) must run offline"
    assert any(needs_hub(code) for _, code in BLOCKS)


@pytest.fixture(scope="session")
def embedded_base(cache_root) -> Path:
    """The embedded base in the dtype `load_default()` picks here, linked into the session's user cache."""
    path = base_model_path(default_dtype("cpu"), cache_dir=cache_root)
    link = default_cache_dir() / path.name  # where load_default() looks ($CLOVER_HF_CACHE, set by conftest)
    if not (link / MARKER_FILE).is_file():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(path, target_is_directory=True)
    return path


@pytest.fixture
def readme_hub(hub_server, embedded_base, other_layouts) -> HubServer:
    """The test Hub holding the base and the heads that the README's Hub blocks load."""
    hub_server.seed(DEFAULT_BASE_NAME, embedded_base, "upload the base model")  # larger than one upload request
    create_repo(HEADS_REPO)
    upload_folder(repo_id=HEADS_REPO, folder_path=shipped_heads_path(), allow_patterns=HEADS_FILES)
    hub_server.seed(MEDUSA_REPO, other_layouts / "medusa", "Medusa heads in FasterDecoding's layout")
    hub_server.seed(CLOVER2_REPO, other_layouts / "clover2", "Clover-2 heads")
    return hub_server


@pytest.fixture(scope="session")
def other_layouts(embedded_base, tmp_path_factory) -> Path:
    """Heads for the embedded base in Medusa's (FasterDecoding) and Clover-2's layouts, random weights, bf16."""
    import torch
    from transformers import AutoModelForCausalLM

    from .test_formats import clover2_checkpoint, medusa_checkpoint

    root = tmp_path_factory.mktemp("layouts")
    base = AutoModelForCausalLM.from_pretrained(embedded_base, dtype=torch.float32)
    medusa_checkpoint(root / "medusa", base, heads=2, layers=1, base_name=DEFAULT_BASE_NAME, dtype=torch.bfloat16)
    clover2_checkpoint(root / "clover2", base, heads=4, layers=2, lm_copies=False, dtype=torch.bfloat16)
    return root


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_block_runs(line, code, request, embedded_base, tmp_path, monkeypatch):
    if needs_hub(code):
        request.getfixturevalue("readme_hub")
    monkeypatch.chdir(tmp_path)  # files a block writes land here
    # Padded so that a traceback names the README's own line numbers.
    program = compile("\n" * (line - 1) + code, str(README), "exec")
    try:
        exec(program, {"__name__": "__main__"})
    finally:
        gc.collect()  # the block's model goes before the next block loads its own
