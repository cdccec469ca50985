import os
from pathlib import Path

import pytest
import torch

pytest_plugins = ["tests.conftest_hub"]


@pytest.fixture(scope="session", autouse=True)
def user_cache(tmp_path_factory):
    """Keep what decoding stores in the user cache (measured verify costs) out of the real one."""
    old = os.environ.get("CLOVER_HF_CACHE")
    os.environ["CLOVER_HF_CACHE"] = str(tmp_path_factory.mktemp("user_cache"))
    yield
    if old is None:
        del os.environ["CLOVER_HF_CACHE"]
    else:
        os.environ["CLOVER_HF_CACHE"] = old


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory) -> Path:
    """Where the embedded model is converted (once per session; CLOVER_HF_TEST_CACHE reuses one)."""
    env = os.environ.get("CLOVER_HF_TEST_CACHE")
    return Path(env) if env else tmp_path_factory.mktemp("clover_hf_cache")


@pytest.fixture(scope="session")
def converted(cache_root) -> Path:
    """The embedded SmolLM2-135M-Instruct as a float32 safetensors directory."""
    from clover_hf.embedded import base_model_path

    return base_model_path(torch.float32, cache_dir=cache_root)


@pytest.fixture
def cli_error(capsys):
    """Run `clover-hf` with these arguments, expecting a user error: it exits with 2 after printing one line,
    `clover-hf: error: ...`, and no traceback. Returns that line."""
    from clover_hf.tools.cli import main

    def run(argv: list[str]) -> str:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit:
            main(argv)
        err = capsys.readouterr().err
        assert exit.value.code == 2 and "Traceback" not in err
        last = err.strip().splitlines()[-1]
        assert last.startswith("clover-hf: error: "), err
        return last

    return run
