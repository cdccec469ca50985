"""Saving and loading heads: a local directory or a Hub repo holding `config.json` + `model.safetensors`
(or heads in Clover-2's or FasterDecoding's Medusa layout, read by `formats.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    HfHubHTTPError,
    HFValidationError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from safetensors.torch import save_file

from clover_hf.heads.config import CONFIG_NAME, WEIGHTS_NAME, CloverConfig
from clover_hf.heads.base import DraftHeads
from clover_hf.heads.build import build_heads

from .formats import (
    CLOVER2_FILES,
    MEDUSA_FILES,
    MEDUSA_WEIGHTS,
    is_clover2_config,
    is_medusa_config,
    read_clover2,
    read_medusa,
    read_safetensors,
)

HEADS_FILES = [CONFIG_NAME, WEIGHTS_NAME, "README.md"]


def _config_data(path: str | Path) -> dict | None:
    try:
        data = json.loads((Path(path) / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def heads_files(path: str | Path) -> list[str] | None:
    """The files of the heads in a directory, by the layout its config names: Clover's (model_type
    'clover'), Clover-2's (a "clover" entry) or Medusa's (medusa_num_heads); None if it holds no heads config."""
    data = _config_data(path)
    if data is None:
        return None
    if data.get("model_type") == "clover":
        return HEADS_FILES
    if is_clover2_config(data):
        return CLOVER2_FILES
    return MEDUSA_FILES if is_medusa_config(data) else None


def is_heads_dir(path: str | Path) -> bool:
    """Whether a local directory holds heads: a Clover config, Clover-2's, or Medusa's in FasterDecoding's layout."""
    return heads_files(path) is not None


def resolve_heads(path_or_repo: str | Path, revision: str | None = None, token: str | bool | None = None,
                  cache_dir: str | Path | None = None, local_files_only: bool = False,
                  force_download: bool = False) -> Path:
    """Local directory of the heads: the path itself, or a download of the Hub repo's heads files.

    Only config.json, model.safetensors and README.md are fetched: nothing executable, no pickles.
    The config comes first, so a repo that holds no heads (a base model, say) is not downloaded.
    """
    path = Path(path_or_repo)
    if path.is_dir():
        return path
    repo_id = str(path_or_repo)
    where = f"Clover heads '{repo_id}' (revision {revision or 'main'})"
    options = dict(revision=revision, token=token, cache_dir=cache_dir, local_files_only=local_files_only,
                   force_download=force_download)
    try:
        local = snapshot_download(repo_id, allow_patterns=[CONFIG_NAME], **options)
        files = heads_files(local)
        if files is not None:
            local = snapshot_download(repo_id, allow_patterns=files, **options)
    except HFValidationError:
        raise OSError(f"'{repo_id}' is neither a local directory nor a valid Hub repo id ('org/name').") from None
    except IncompleteSnapshotError as err:
        raise OSError(f"{where}: the cached copy is incomplete and cannot be completed now. {err}") from None
    except LocalEntryNotFoundError as err:
        if constants.is_offline_mode() or isinstance(err.__cause__, OfflineModeIsEnabled):
            # The message says everything: no traceback of the HTTP layer that was never called.
            raise OSError(
                f"{where} are not in the local cache and HF_HUB_OFFLINE is set (offline mode). "
                "Download them once while online, or pass a local directory."
            ) from None
        raise OSError(
            f"{where} are not in the local cache and the Hub could not be reached. "
            "Check the connection, or pass a local directory."
        ) from err
    except RepositoryNotFoundError as err:
        raise OSError(
            f"'{repo_id}' is neither a local directory nor a Hub repo you can access "
            "(check the name, or log in with `hf auth login` / pass token=... for a private repo)."
        ) from err
    except RevisionNotFoundError as err:
        raise OSError(f"revision '{revision}' does not exist in the Hub repo '{repo_id}'.") from err
    except HfHubHTTPError as err:
        raise OSError(f"could not download {where}: {err}") from err
    return Path(local)


def save_heads(heads: DraftHeads, directory: str | Path, safe_serialization: bool = True) -> Path:
    """Write config.json and model.safetensors (the heads' own weights only)."""
    if not safe_serialization:
        raise ValueError("Clover heads are saved as safetensors only (safe_serialization=True)")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    heads.config.save(directory)
    state = {k: v.detach().contiguous().cpu() for k, v in heads.state_dict().items()}
    save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": "pt", "library": "clover-hf"})
    (directory / WEIGHTS_NAME).chmod(0o644)  # safetensors writes 0600; heads are meant to be shared
    return directory


def load_heads(directory: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> DraftHeads:
    """Build heads from config.json and fill them from model.safetensors, checking every key and shape."""
    directory = Path(directory)
    data = _config_data(directory)
    if is_medusa_config(data):
        config, state = read_medusa(directory, data)
        weights = directory / MEDUSA_WEIGHTS
    elif is_clover2_config(data):
        config, state = read_clover2(directory, data)
        weights = directory / WEIGHTS_NAME
    else:
        config = CloverConfig.load(directory)
        weights = directory / WEIGHTS_NAME
        if not weights.is_file():
            raise FileNotFoundError(
                f"no heads weights at {weights} (expected {WEIGHTS_NAME} next to {CONFIG_NAME}). Clover reads heads "
                "from safetensors only: pickle checkpoints (pytorch_model.bin, *.pt) are never loaded."
            )
        state = read_safetensors(weights)
    heads = build_heads(config)
    state = heads.upgrade_state_dict(state)
    expected = heads.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{weights} does not match {directory / CONFIG_NAME}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, tensor in state.items():
        want = expected[name]
        if tensor.shape != want.shape:
            raise ValueError(f"{weights}: '{name}' has shape {tuple(tensor.shape)}, config implies {tuple(want.shape)}")
        if tensor.dtype.is_floating_point != want.dtype.is_floating_point:
            raise ValueError(f"{weights}: '{name}' has dtype {tensor.dtype}, expected a {want.dtype}-like tensor")
    if heads.draft_token_ids is not None:
        ids = state["draft_token_ids"]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size):
            raise ValueError(f"{weights}: draft_token_ids fall outside the vocabulary of {config.vocab_size}")
    heads.load_state_dict(state)
    return heads.to(device=device, dtype=dtype) if dtype is not None else heads.to(device)
