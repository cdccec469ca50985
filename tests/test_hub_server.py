"""Tests for the fake Hub server, driven through real huggingface_hub / transformers client calls."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest
from huggingface_hub import (
    CommitOperationAdd,
    CommitOperationDelete,
    HfApi,
    constants,
    create_commit,
    create_repo,
    file_exists,
    get_paths_info,
    hf_hub_download,
    hf_hub_url,
    list_repo_commits,
    list_repo_files,
    list_repo_refs,
    list_repo_tree,
    model_info,
    repo_info,
    snapshot_download,
    upload_file,
    upload_folder,
    whoami,
)
from huggingface_hub.errors import (
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from tests.conftest_hub import set_hf_offline
from tests.hub_server import HubServer, git_blob_oid

pytestmark = pytest.mark.usefixtures("no_network")

README = "---\nlicense: mit\ntags:\n- test\n---\n# Tiny repo\n"


def _make_folder(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "README.md").write_text(README)
    (root / "config.json").write_text('{"a": 1}')
    (root / "sub" / "data.txt").write_text("hello")
    return root


def test_fixture_points_huggingface_hub_at_server(hub_server, tmp_path):
    assert constants.ENDPOINT == hub_server.url
    assert hf_hub_url("org/x", "f.txt").startswith(hub_server.url + "/org/x/resolve/main/")
    assert HfApi().endpoint == hub_server.url
    assert Path(constants.HF_HUB_CACHE).is_relative_to(tmp_path)
    assert whoami()["name"] == hub_server.user


def test_create_repo(hub_server):
    url = create_repo("org/model", private=False)
    assert url.repo_id == "org/model" and url.startswith(hub_server.url)
    with pytest.raises(HfHubHTTPError) as exc:
        create_repo("org/model")
    assert exc.value.response.status_code == 409
    assert create_repo("org/model", exist_ok=True).repo_id == "org/model"
    assert create_repo("mine").repo_id == f"{hub_server.user}/mine"  # no namespace -> user's

    info = model_info("org/model")
    assert len(info.sha) == 40 and info.private is False
    assert [s.rfilename for s in info.siblings] == [".gitattributes"]  # initial commit, as on the Hub
    refs = list_repo_refs("org/model")
    assert [(b.name, b.target_commit) for b in refs.branches] == [("main", info.sha)]
    with pytest.raises(RepositoryNotFoundError):
        repo_info("org/missing")

    create_repo("org/data", repo_type="dataset")
    assert repo_info("org/data", repo_type="dataset").id == "org/data"
    with pytest.raises(RepositoryNotFoundError):
        model_info("org/data")  # wrong repo type


def test_upload_folder_and_download(hub_server, tmp_path):
    create_repo("org/repo")
    commit = upload_folder(repo_id="org/repo", folder_path=_make_folder(tmp_path / "src"), commit_message="add")
    assert len(commit.oid) == 40 and commit.repo_url.repo_id == "org/repo"
    assert ("POST", "/api/validate-yaml") in hub_server.requests  # README.md front matter got validated

    assert sorted(list_repo_files("org/repo")) == [".gitattributes", "README.md", "config.json", "sub/data.txt"]
    top = {e.path: type(e).__name__ for e in list_repo_tree("org/repo")}
    assert top == {".gitattributes": "RepoFile", "README.md": "RepoFile", "config.json": "RepoFile",
                   "sub": "RepoFolder"}
    assert [e.path for e in list_repo_tree("org/repo", path_in_repo="sub")] == ["sub/data.txt"]
    infos = {e.path: e for e in get_paths_info("org/repo", ["config.json", "sub", "nope"])}
    assert set(infos) == {"config.json", "sub"} and infos["config.json"].blob_id == git_blob_oid(b'{"a": 1}')
    info = model_info("org/repo")
    assert info.sha == commit.oid and {s.rfilename for s in info.siblings} >= {"README.md", "sub/data.txt"}
    assert file_exists("org/repo", "sub/data.txt") and not file_exists("org/repo", "nope.txt")

    path = hf_hub_download("org/repo", "sub/data.txt")
    assert Path(path).read_text() == "hello" and f"snapshots/{commit.oid}/sub/data.txt" in path
    assert Path(hf_hub_download("org/repo", "README.md", local_dir=tmp_path / "ld")).read_text() == README
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download("org/repo", "nope.txt")

    snap = Path(snapshot_download("org/repo"))
    assert snap.name == commit.oid
    assert (snap / "config.json").read_text() == '{"a": 1}' and (snap / "sub" / "data.txt").read_text() == "hello"


def test_revision_pinning(hub_server, tmp_path):
    create_repo("org/rev")
    first = upload_file(path_or_fileobj=b"v1", path_in_repo="w.txt", repo_id="org/rev")
    second = upload_file(path_or_fileobj=b"v2", path_in_repo="w.txt", repo_id="org/rev")
    assert first.oid != second.oid
    assert Path(hf_hub_download("org/rev", "w.txt")).read_bytes() == b"v2"
    assert Path(hf_hub_download("org/rev", "w.txt", revision=first.oid)).read_bytes() == b"v1"
    assert Path(hf_hub_download("org/rev", "w.txt", revision=first.oid[:7], force_download=True)).read_bytes() == b"v1"
    assert (Path(snapshot_download("org/rev", revision=first.oid)) / "w.txt").read_bytes() == b"v1"
    assert model_info("org/rev", revision=first.oid).sha == first.oid
    assert [c.commit_id for c in list_repo_commits("org/rev")][:2] == [second.oid, first.oid]
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download("org/rev", "w.txt", revision="no-such-branch")

    # Re-uploading identical content is a no-op commit (the preupload endpoint reports the remote oid).
    assert upload_file(path_or_fileobj=b"v2", path_in_repo="w.txt", repo_id="org/rev").oid == second.oid
    third = create_commit("org/rev", commit_message="swap", parent_commit=second.oid, operations=[
        CommitOperationDelete("w.txt"), CommitOperationAdd("x/y.txt", b"y")])
    assert list_repo_files("org/rev") == [".gitattributes", "x/y.txt"]
    assert list_repo_files("org/rev", revision=second.oid) == [".gitattributes", "w.txt"]
    with pytest.raises(HfHubHTTPError) as exc:  # stale parent commit
        create_commit("org/rev", commit_message="late", parent_commit=second.oid,
                      operations=[CommitOperationAdd("z.txt", b"z")])
    assert exc.value.response.status_code == 412 and model_info("org/rev").sha == third.oid


def test_private_repo_needs_token(hub_server, tmp_path):
    create_repo("org/secret", private=True)
    upload_file(path_or_fileobj=b"s3cret", path_in_repo="s.txt", repo_id="org/secret")
    assert model_info("org/secret").private is True
    assert Path(hf_hub_download("org/secret", "s.txt")).read_bytes() == b"s3cret"

    with pytest.raises(RepositoryNotFoundError):
        model_info("org/secret", token=False)
    with pytest.raises(RepositoryNotFoundError):
        # (a fresh cache: with the file cached, a failed HEAD call falls back to the cached copy)
        hf_hub_download("org/secret", "s.txt", token=False, cache_dir=tmp_path / "anon")
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("org/secret", token=False, cache_dir=tmp_path / "anon")
    with pytest.raises(HfHubHTTPError) as exc:
        HfApi(token="hf_wrong").model_info("org/secret")
    assert exc.value.response.status_code == 401


def test_writes_need_token(hub_server):
    with pytest.raises(HfHubHTTPError) as exc:
        create_repo("org/anon", token=False)
    assert exc.value.response.status_code == 401
    create_repo("org/pub")
    with pytest.raises(HfHubHTTPError):
        upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id="org/pub", token=False)
    # Public repos stay readable anonymously.
    assert model_info("org/pub", token=False).id == "org/pub"


def test_whoami(hub_server):
    me = whoami()
    assert me["name"] == "tester" and me["auth"]["accessToken"]["role"] == "write"
    assert whoami(token=hub_server.token)["name"] == "tester"
    with pytest.raises(HfHubHTTPError) as exc:
        whoami(token="hf_invalid")
    assert exc.value.response.status_code == 401


def test_offline_mode(hub_server, monkeypatch):
    create_repo("org/off")
    upload_file(path_or_fileobj=b"cached", path_in_repo="a.txt", repo_id="org/off")
    upload_file(path_or_fileobj=b"never", path_in_repo="b.txt", repo_id="org/off")
    cached = hf_hub_download("org/off", "a.txt")
    snapshot_download("org/off", allow_patterns=["a.txt"])

    set_hf_offline(monkeypatch)
    before = len(hub_server.requests)
    assert hf_hub_download("org/off", "a.txt") == cached
    assert Path(snapshot_download("org/off", allow_patterns=["a.txt"]), "a.txt").read_bytes() == b"cached"
    with pytest.raises(LocalEntryNotFoundError) as exc:
        hf_hub_download("org/off", "b.txt")
    assert isinstance(exc.value.__cause__, OfflineModeIsEnabled)
    with pytest.raises(OfflineModeIsEnabled):
        model_info("org/off")
    assert len(hub_server.requests) == before  # nothing reached the server


def test_transformers_autoconfig(hub_server, tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, vocab_size=64)
    cfg.save_pretrained(tmp_path / "cfg")
    create_repo("org/tiny-llama")
    commit = upload_folder(repo_id="org/tiny-llama", folder_path=tmp_path / "cfg")

    loaded = transformers.AutoConfig.from_pretrained("org/tiny-llama")
    assert loaded.model_type == "llama" and loaded.hidden_size == 16 and loaded.num_hidden_layers == 1
    assert transformers.AutoConfig.from_pretrained("org/tiny-llama", revision=commit.oid).hidden_size == 16
    # transformers resolves "main" to a commit via repo_info, then downloads at that commit
    assert ("GET", f"/org/tiny-llama/resolve/{commit.oid}/config.json") in hub_server.requests

    set_hf_offline(monkeypatch)
    assert transformers.AutoConfig.from_pretrained("org/tiny-llama").hidden_size == 16
    with pytest.raises(OSError):
        transformers.AutoConfig.from_pretrained("org/not-cached")


def test_server_lifecycle(tmp_path):
    with HubServer() as server:  # no token configured: everything is allowed anonymously
        req = urllib.request.Request(server.url + "/api/repos/create", method="POST",
                                     data=b'{"name": "r", "organization": "o"}')
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert resp.status == 200
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(server.url + "/api/nope", timeout=5)
        assert exc.value.code == 404
        with pytest.raises(urllib.error.HTTPError) as exc:  # malformed body: a 4xx (clients retry 5xx)
            urllib.request.urlopen(urllib.request.Request(server.url + "/api/repos/create", data=b"{"), timeout=5)
        assert exc.value.code == 400 and "JSONDecodeError" in exc.value.headers["X-Error-Message"]
        root = server.root
    assert not root.exists()  # own temp dir removed
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url + "/api/models/o/r", timeout=2)

    server = HubServer(max_lifetime=0.2).start()  # stops itself
    server._timer.join(5)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url + "/api/models/o/r", timeout=2)
