"""Pytest plugin providing ``hub_server``: a local fake Hub that huggingface_hub and transformers talk to.

Use it with ``pytest_plugins = ["tests.conftest_hub"]`` in the root conftest, or
``from tests.conftest_hub import hub_server`` in a conftest/test module.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from .hub_server import HubServer

HUB_TOKEN = "hf_fakehubtoken0123456789abcdefghijkl"
HUB_USER = "tester"

# Env vars that could make huggingface_hub use another token, endpoint or cache than the fake Hub's.
_CLEARED_ENV = ("HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_OIDC_ID_TOKEN", "HF_HUB_DISABLE_IMPLICIT_TOKEN",
                "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HUGGINGFACE_CO_STAGING", "HUGGINGFACE_HUB_CACHE",
                "HUGGINGFACE_ASSETS_CACHE", "TRANSFORMERS_CACHE")


def point_hf_at(url: str, token: str | None, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point huggingface_hub (and transformers) at ``url`` with ``token``, caching under ``home``.

    huggingface_hub reads most settings from env vars once, at import time, into module-level constants; both
    the env vars (for code imported later / subprocesses) and the cached constants are patched.
    """
    from huggingface_hub import constants, hf_api
    from huggingface_hub.utils import _http

    home = Path(home)
    paths = {"HF_HOME": home, "HF_HUB_CACHE": home / "hub", "HF_ASSETS_CACHE": home / "assets",
             "HF_XET_CACHE": home / "xet", "HF_TOKEN_PATH": home / "token", "HF_MODULES_CACHE": home / "modules"}
    for name in _CLEARED_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, path in paths.items():
        monkeypatch.setenv(name, str(path))
    monkeypatch.setenv("HF_ENDPOINT", url)
    if token is None:
        monkeypatch.delenv("HF_TOKEN", raising=False)
    else:
        monkeypatch.setenv("HF_TOKEN", token)
    for name in ("HF_HUB_DISABLE_TELEMETRY", "HF_HUB_DISABLE_XET", "HF_HUB_DISABLE_UPDATE_CHECK"):
        monkeypatch.setenv(name, "1")
    no_proxy = ",".join(filter(None, ["127.0.0.1", "localhost", os.environ.get("NO_PROXY")]))
    monkeypatch.setenv("NO_PROXY", no_proxy)
    monkeypatch.setenv("no_proxy", no_proxy)

    for name, value in {
        "ENDPOINT": url,
        "HUGGINGFACE_CO_URL_TEMPLATE": url + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_URL_HOSTS": constants.HF_URL_HOSTS | {urlsplit(url).hostname},
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(paths["HF_HUB_CACHE"]),
        "HUGGINGFACE_HUB_CACHE": str(paths["HF_HUB_CACHE"]),
        "HF_ASSETS_CACHE": str(paths["HF_ASSETS_CACHE"]),
        "HUGGINGFACE_ASSETS_CACHE": str(paths["HF_ASSETS_CACHE"]),
        "HF_XET_CACHE": str(paths["HF_XET_CACHE"]),
        "HF_TOKEN_PATH": str(paths["HF_TOKEN_PATH"]),
        "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": False,
        "HF_HUB_DISABLE_TELEMETRY": True,
        "HF_HUB_DISABLE_XET": True,
    }.items():
        monkeypatch.setattr(constants, name, value)
    # `huggingface_hub.create_repo`, `upload_folder`, ... are bound methods of this instance, created at import.
    monkeypatch.setattr(hf_api.api, "endpoint", url)
    # Origins the auth header may be forwarded to when following redirects.
    monkeypatch.setattr(_http, "_HUB_ORIGINS", _http._HUB_ORIGINS | {_http._url_origin(url)})
    # transformers keeps one HfApi bound to the endpoint of its first use: make it build a new one.
    hub_module = sys.modules.get("transformers.utils.hub")
    if hub_module is not None and hasattr(hub_module, "_hf_api"):
        monkeypatch.setattr(hub_module, "_hf_api", None)
    # transformers caches its remote-code folder at import time.
    for module in ("transformers.utils.hub", "transformers.utils", "transformers.dynamic_module_utils"):
        if hasattr(sys.modules.get(module), "HF_MODULES_CACHE"):
            monkeypatch.setattr(sys.modules[module], "HF_MODULES_CACHE", str(paths["HF_MODULES_CACHE"]))
    _reset_clients()


def _reset_clients() -> None:
    """Drop huggingface_hub's shared HTTP client (pooled connections, proxy env) and cached HfFileSystems."""
    from huggingface_hub.utils import close_session

    close_session()
    if "huggingface_hub.hf_file_system" in sys.modules:
        sys.modules["huggingface_hub.hf_file_system"].HfFileSystem.clear_instance_cache()


def set_hf_offline(monkeypatch: pytest.MonkeyPatch, offline: bool = True) -> None:
    """Toggle huggingface_hub/transformers offline mode (``HF_HUB_OFFLINE``) for the rest of the test."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any DNS lookup or connection to a non-loopback address fail loudly."""
    local = ("127.0.0.1", "::1", "localhost")
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in local:
            raise RuntimeError(f"test tried to reach the network: {address}")
        return real_connect(sock, address)

    def getaddrinfo(host, *args, **kwargs):
        if host not in local and host is not None:
            raise RuntimeError(f"test tried to resolve {host!r}")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.fixture
def hub_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    """A running fake Hub (``.url``, ``.token``, ``.user``, ``.requests``) that huggingface_hub points at."""
    with HubServer(token=HUB_TOKEN, user=HUB_USER, root=tmp_path / "fake_hub", max_lifetime=300) as server:
        point_hf_at(server.url, server.token, tmp_path / "hf_home", monkeypatch)
        try:
            yield server
        finally:
            _reset_clients()
