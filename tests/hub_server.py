"""A tiny, stdlib-only fake of the Hugging Face Hub HTTP API, for tests.

Implements what ``huggingface_hub`` (and thus ``transformers``) needs to create repos, commit files
(regular uploads only, no LFS/Xet), read repo info/trees/refs/commits and download files through
``/{repo_id}/resolve/{revision}/{path}``. Blobs live in a temp directory; repo metadata in memory.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import tempfile
import threading
import time
from collections import deque
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
_API_TYPE = {"models": "model", "datasets": "dataset", "spaces": "space"}
_URL_TYPE = {None: "model", "datasets": "dataset", "spaces": "space"}
_REPO = r"(?P<repo>[^/]+/[^/]+)"
_API = r"^/api/(?P<t>models|datasets|spaces)/" + _REPO
_MAX_BODY = 64 * 1024 * 1024
_GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"
_INVALID_CREDS = "Invalid credentials in Authorization header"


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def git_blob_oid(data: bytes) -> str:
    """Git blob sha1 of ``data`` (what the Hub reports as ETag/oid for non-LFS files)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubError(Exception):
    """An HTTP error answered Hub-style (``X-Error-Code`` / ``X-Error-Message`` headers)."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


class _Repo:
    """In-memory repo state: commits (sha -> {parent, files, title, date}) and branches (name -> sha)."""

    def __init__(self, private: bool):
        self.private, self.created = private, _now()
        self.commits: dict[str, dict] = {}
        self.branches: dict[str, str] = {}

    def resolve(self, revision: str) -> str:
        if revision in self.branches:
            return self.branches[revision]
        if len(revision) >= 7 and re.fullmatch(r"[0-9a-f]+", revision):
            matches = [sha for sha in self.commits if sha.startswith(revision)]
            if len(matches) == 1:
                return matches[0]
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")


class HubServer:
    """Fake Hub on ``127.0.0.1:<ephemeral port>``; use as a context manager or call ``start()``/``stop()``.

    ``token``: if set, writes need ``Authorization: Bearer <token>`` and any other bearer token is rejected (401).
    ``max_lifetime``: seconds after which the server stops itself (safety net for leaked servers).
    """

    def __init__(self, token: str | None = None, user: str = "tester", root: str | Path | None = None,
                 max_lifetime: float = 600.0):
        self.token, self.user, self.max_lifetime = token, user, max_lifetime
        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="fake-hub-") if root is None else root)
        self.repos: dict[tuple[str, str], _Repo] = {}
        self.requests: deque[tuple[str, str]] = deque(maxlen=2000)  # (method, path) log, for assertions
        self._lock = threading.RLock()
        self._httpd: ThreadingHTTPServer | None = None
        self._timer: threading.Timer | None = None
        self.url = ""

    def start(self) -> HubServer:
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.hub = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self._timer = threading.Timer(self.max_lifetime, self.stop)
        self._timer.daemon = True
        self._timer.start()
        return self

    def stop(self) -> None:
        with self._lock:
            httpd, self._httpd = self._httpd, None
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.cancel()
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
            if self._own_root:
                shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _put_blob(self, data: bytes) -> str:
        oid = git_blob_oid(data)
        path = self.root / "blobs" / oid
        if not path.exists():
            path.write_bytes(data)
        return oid

    def _size(self, oid: str) -> int:
        return (self.root / "blobs" / oid).stat().st_size

    def _commit(self, repo: _Repo, branch: str, files: dict[str, str], title: str) -> str:
        parent = repo.branches.get(branch)
        seed = json.dumps([parent, sorted(files.items()), title, len(repo.commits), time.time_ns()])
        sha = hashlib.sha1(seed.encode()).hexdigest()
        repo.commits[sha] = {"parent": parent, "files": files, "title": title, "date": _now()}
        repo.branches[branch] = sha
        return sha

    def seed(self, repo_id: str, folder: str | Path, title: str = "seed") -> str:
        """Put a folder into a public model repo as one commit, straight into the store: for files larger
        than one upload request may carry (a base model). Returns the commit."""
        folder = Path(folder)
        files = {p.relative_to(folder).as_posix(): self._put_blob(p.read_bytes())
                 for p in sorted(folder.rglob("*")) if p.is_file()}
        with self._lock:
            repo = self.repos.setdefault(("model", repo_id), _Repo(private=False))
            return self._commit(repo, "main", files, title)

    def repo_url(self, rtype: str, repo_id: str) -> str:
        return f"{self.url}/{_PREFIX[rtype]}{repo_id}"


class _Handler(BaseHTTPRequestHandler):
    """Routes requests to the ``HubServer`` attached to the HTTP server."""

    protocol_version = "HTTP/1.0"  # one request per connection: nothing lingers after stop()
    timeout = 30

    routes = [
        ("GET", r"^/api/whoami-v2$", "whoami"),
        ("POST", r"^/api/repos/create$", "create_repo"),
        ("DELETE", r"^/api/repos/delete$", "delete_repo"),
        ("POST", r"^/api/validate-yaml$", "validate_yaml"),
        ("GET", _API + r"(?:/revision/(?P<rev>[^/]+))?$", "repo_info"),
        ("GET", _API + r"/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?$", "tree"),
        ("POST", _API + r"/paths-info/(?P<rev>[^/]+)$", "paths_info"),
        ("GET", _API + r"/refs$", "refs"),
        ("GET", _API + r"/commits/(?P<rev>[^/]+)$", "commits"),
        ("POST", _API + r"/preupload/(?P<rev>[^/]+)$", "preupload"),
        ("POST", _API + r"/commit/(?P<rev>[^/]+)$", "commit"),
        ("POST", _API + r"/branch/(?P<branch>[^/]+)$", "create_branch"),
        ("GET", r"^/(?:(?P<t>datasets|spaces)/)?" + _REPO + r"/resolve/(?P<rev>[^/]+)/(?P<path>.+)$", "resolve"),
    ]

    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def do_GET(self) -> None:
        self._dispatch(self.command)

    do_HEAD = do_POST = do_DELETE = do_GET

    def _dispatch(self, method: str) -> None:
        self.hub: HubServer = self.server.hub  # type: ignore[attr-defined]
        split = urlsplit(self.path)
        self.query = parse_qs(split.query)
        self.hub.requests.append((method, split.path))
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if length > _MAX_BODY:
                raise HubError(413, "Payload too large")
            self.body = self.rfile.read(length) if length else b""  # read first: never leave a body unread
            self.authed = self._check_token()
            for verb, pattern, name in self.routes:
                m = re.match(pattern, split.path)
                if m and (verb == method or (verb == "GET" and method == "HEAD")):
                    args = {k: unquote(v) for k, v in m.groupdict().items() if v is not None}
                    with self.hub._lock:
                        return getattr(self, "h_" + name)(**args)
            raise HubError(404, f"Unknown route: {method} {split.path}")
        except (BrokenPipeError, ConnectionResetError):
            pass  # client went away
        except Exception as exc:  # malformed request or bug => 400, not 5xx: clients retry 5xx with backoff
            e = exc if isinstance(exc, HubError) else HubError(400, f"Bad request ({type(exc).__name__}: {exc})")
            msg = " ".join(e.message.encode("ascii", "replace").decode().split())[:300]
            code = {"X-Error-Code": e.code} if e.code else {}
            headers = {"X-Error-Message": msg, **code, **e.headers}
            self._send(e.status, json.dumps({"error": e.message}).encode(), headers)

    def _check_token(self) -> bool:
        auth = self.headers.get("Authorization", "")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        if token is not None and self.hub.token is not None and token != self.hub.token:
            raise HubError(401, _INVALID_CREDS)
        return self.hub.token is None or token == self.hub.token

    def _send(self, status: int, body: bytes, headers: dict | None = None, ctype="application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj, status: int = 200) -> None:
        self._send(status, json.dumps(obj).encode())

    def _need_write(self) -> None:
        if not self.authed:
            raise HubError(401, "You must be authenticated to perform this action")

    def _repo(self, t: str | None, repo: str, api: bool = True) -> tuple[str, _Repo]:
        rtype = _API_TYPE[t] if api else _URL_TYPE[t]
        r = self.hub.repos.get((rtype, repo))
        if r is None or (r.private and not self.authed):
            raise HubError(404 if r is None or self.authed else 401, "Repository not found", "RepoNotFound")
        return rtype, r

    def _files(self, t: str, repo: str, rev: str) -> tuple[_Repo, str, dict[str, str]]:
        r = self._repo(t, repo)[1]
        sha = r.resolve(rev)
        return r, sha, r.commits[sha]["files"]

    def _payload_key(self) -> tuple[str, str]:
        payload = json.loads(self.body or b"{}")
        return payload.get("type") or "model", f"{payload.get('organization') or self.hub.user}/{payload['name']}"

    def _file_entry(self, path: str, oid: str) -> dict:
        return {"type": "file", "oid": oid, "size": self.hub._size(oid), "path": path}

    @staticmethod
    def _dir_entry(path: str) -> dict:
        return {"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "size": 0, "path": path}

    def h_whoami(self) -> None:
        if not self.authed or "Authorization" not in self.headers:
            raise HubError(401, _INVALID_CREDS)
        self._json({"type": "user", "id": "0" * 24, "name": self.hub.user, "fullname": self.hub.user, "orgs": [],
                    "auth": {"type": "access_token", "accessToken": {"displayName": "test", "role": "write"}}})

    def h_create_repo(self) -> None:
        self._need_write()
        rtype, repo_id = self._payload_key()
        url = self.hub.repo_url(rtype, repo_id)
        if (rtype, repo_id) in self.hub.repos:
            return self._json({"error": "You already created this repo", "url": url}, 409)
        repo = self.hub.repos[(rtype, repo_id)] = _Repo(json.loads(self.body).get("visibility") == "private")
        self.hub._commit(repo, "main", {".gitattributes": self.hub._put_blob(_GITATTRIBUTES)}, "initial commit")
        self._json({"url": url, "name": repo_id, "id": repo_id})

    def h_delete_repo(self) -> None:
        self._need_write()
        if self.hub.repos.pop(self._payload_key(), None) is None:
            raise HubError(404, "Repository not found", "RepoNotFound")
        self._json({})

    def h_validate_yaml(self) -> None:
        self._json({"errors": [], "warnings": []})

    def h_repo_info(self, t: str, repo: str, rev: str = "main") -> None:
        r, sha, files = self._files(t, repo, rev)
        self._json({"id": repo, "author": repo.split("/")[0], "sha": sha, "private": r.private, "gated": False,
                    "disabled": False, "lastModified": r.commits[sha]["date"], "createdAt": r.created, "tags": [],
                    "downloads": 0, "likes": 0, "siblings": [
                        {"rfilename": p, "size": self.hub._size(o), "blobId": o} for p, o in sorted(files.items())]})

    def h_tree(self, t: str, repo: str, rev: str, path: str = "") -> None:
        files = self._files(t, repo, rev)[2]
        recursive = self.query.get("recursive", ["false"])[0].lower() in ("1", "true")
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        out: dict[str, dict] = {}
        for p, oid in sorted(files.items()):
            if not p.startswith(prefix):
                continue
            parts = p[len(prefix):].split("/")
            for i in range(1, len(parts) if recursive else min(2, len(parts))):
                d = prefix + "/".join(parts[:i])
                out.setdefault(d, self._dir_entry(d))
            if recursive or len(parts) == 1:
                out[p] = self._file_entry(p, oid)
        if prefix and not out:
            raise HubError(404, f"{path} does not exist", "EntryNotFound")
        self._json(sorted(out.values(), key=lambda e: (e["type"] != "directory", e["path"])))

    def h_paths_info(self, t: str, repo: str, rev: str) -> None:
        files, out = self._files(t, repo, rev)[2], []
        for p in parse_qs(self.body.decode()).get("paths", []):
            if p in files:
                out.append(self._file_entry(p, files[p]))
            elif any(f.startswith(p.rstrip("/") + "/") for f in files):
                out.append(self._dir_entry(p.rstrip("/")))
        self._json(out)

    def h_refs(self, t: str, repo: str) -> None:
        _, r = self._repo(t, repo)
        branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": s} for b, s in r.branches.items()]
        self._json({"branches": branches, "converts": [], "tags": [], "pullRequests": []})

    def h_create_branch(self, t: str, repo: str, branch: str) -> None:
        self._need_write()
        _, r = self._repo(t, repo)
        branch = unquote(branch)
        if branch in r.branches:
            raise HubError(409, f"Reference already exists: refs/heads/{branch}")
        start = json.loads(self.body or b"{}").get("startingPoint") or "main"
        r.branches[branch] = r.resolve(start)
        self._json({})

    def h_commits(self, t: str, repo: str, rev: str) -> None:
        _, r = self._repo(t, repo)
        sha, out = r.resolve(rev), []
        while sha is not None:
            c = r.commits[sha]
            out.append({"id": sha, "title": c["title"], "message": "", "date": c["date"],
                        "authors": [{"user": self.hub.user}]})
            sha = c["parent"]
        self._json(out)

    def h_preupload(self, t: str, repo: str, rev: str) -> None:
        self._need_write()
        files = self._files(t, repo, rev)[2]
        self._json({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                               "oid": files.get(f["path"])} for f in json.loads(self.body)["files"]]})

    def h_commit(self, t: str, repo: str, rev: str) -> None:
        self._need_write()
        rtype, r = self._repo(t, repo)
        if "create_pr" in self.query:
            raise HubError(400, "Pull requests are not supported by the fake Hub")
        if rev not in r.branches:
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        lines = [json.loads(line) for line in self.body.splitlines() if line.strip()]
        header = next((x["value"] for x in lines if x["key"] == "header"), {})
        head = r.branches[rev]
        if header.get("parentCommit") not in (None, head):
            raise HubError(412, "A commit has happened since. Please refresh and try again.")
        files = dict(r.commits[head]["files"])
        for op in lines:
            key, value = op["key"], op["value"]
            if key == "file":
                files[value["path"]] = self.hub._put_blob(base64.b64decode(value["content"]))
            elif key == "deletedFile":
                if files.pop(value["path"], None) is None:
                    raise HubError(404, "A file with this name doesn't exist", "EntryNotFound")
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                files = {p: o for p, o in files.items() if not p.startswith(prefix)}
            elif key != "header":
                raise HubError(400, f"Unsupported commit operation: {key}")
        sha = self.hub._commit(r, rev, files, header.get("summary") or "commit")
        self._json({"success": True, "commitOid": sha, "pullRequestUrl": None,
                    "commitUrl": f"{self.hub.repo_url(rtype, repo)}/commit/{sha}"})

    def h_resolve(self, repo: str, rev: str, path: str, t: str | None = None) -> None:
        _, r = self._repo(t, repo, api=False)
        sha = r.resolve(rev)
        oid = r.commits[sha]["files"].get(path)
        if oid is None:
            raise HubError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": sha})
        data = (self.hub.root / "blobs" / oid).read_bytes()
        headers = {"X-Repo-Commit": sha, "ETag": f'"{oid}"', "Accept-Ranges": "bytes"}
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if m and int(m.group(1)) < len(data):
            start, end = int(m.group(1)), int(m.group(2) or len(data) - 1)
            headers["Content-Range"] = f"bytes {start}-{min(end, len(data) - 1)}/{len(data)}"
            return self._send(206, data[start:end + 1], headers, "application/octet-stream")
        self._send(200, data, headers, "application/octet-stream")
