"""A fake Hugging Face Hub for tests: an in-memory HTTP server on loopback for the real `huggingface_hub` client.

`FakeHub` implements, for model repositories only (shapes as used by huggingface_hub 2.4):

- `POST /api/repos/create` (409 if it exists), `GET /api/whoami-v2`, `POST /api/validate-yaml` (always valid);
- `GET /api/models/{repo}` and `.../revision/{rev}` (repo_info / model_info, `?blobs=true` adds file metadata);
- `GET /api/models/{repo}/tree/{rev}[/{path}]` (`?recursive=true`), `GET .../refs`, `POST .../branch/{branch}`;
- `POST /api/models/{repo}/preupload/{rev}` and `POST .../commit/{rev}` (NDJSON: header, file, lfsFile,
  deletedFile, deletedFolder; `parentCommit` is honoured);
- the Git LFS batch API with the "basic" transfer: `POST /{repo}.git/info/lfs/objects/batch`, the upload action
  `PUT /_lfs/{oid}` (sha256 checked) and the verify action `POST /{repo}.git/info/lfs/objects/verify`;
- `HEAD`/`GET /{repo}/resolve/{rev}/{path}` with the `X-Repo-Commit`, `ETag`, `X-Linked-Etag`, `X-Linked-Size` headers
  and `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound) on errors.

Not implemented: datasets and spaces, tags, pull requests, pagination, multipart LFS, Range requests and Xet. The
client uploads through Xet whenever `hf_xet` is installed (it then fails on `/xet-write-token` with a 404): point it
at this server with `FakeHub.patch_client`, which also disables Xet, or set `HF_HUB_DISABLE_XET=1`.
"""

import base64
import hashlib
import json
import os
import re
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from fnmatch import fnmatch
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from urllib.parse import parse_qsl, unquote, urlsplit

LFS_SIZE_THRESHOLD = 10 * 1024 * 1024  # bigger files go through LFS whatever their name
LFS_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.onnx")
GITATTRIBUTES = "".join(f"{pattern} filter=lfs diff=lfs merge=lfs -text\n" for pattern in LFS_PATTERNS)
INVALID_TOKEN = "Invalid credentials in Authorization header"  # the real message; the client then raises a plain 401

_REPO = r"(?P<repo>[^/]+/[^/]+)"
_API = rf"/api/models/{_REPO}"
# (methods, path pattern, kind): the kind names the `_on_<kind>` method and is what `FakeHub.fail` refers to.
_ROUTES = [
    ({"POST"}, r"/api/repos/create", "create_repo"),
    ({"GET"}, r"/api/whoami-v2", "whoami"),
    ({"POST"}, r"/api/validate-yaml", "validate_yaml"),
    ({"GET"}, rf"{_API}(?:/revision/(?P<rev>[^/]+))?", "info"),
    ({"GET"}, rf"{_API}/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?", "tree"),
    ({"GET"}, rf"{_API}/refs", "refs"),
    ({"POST"}, rf"{_API}/branch/(?P<branch>[^/]+)", "branch"),
    ({"POST"}, rf"{_API}/preupload/(?P<rev>[^/]+)", "preupload"),
    ({"POST"}, rf"{_API}/commit/(?P<rev>[^/]+)", "commit"),
    ({"POST"}, rf"/{_REPO}\.git/info/lfs/objects/batch", "lfs_batch"),
    ({"PUT"}, r"/_lfs/(?P<oid>[0-9a-f]{64})", "lfs_upload"),
    ({"POST"}, rf"/{_REPO}\.git/info/lfs/objects/verify", "lfs_verify"),
    ({"HEAD", "GET"}, rf"/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "resolve"),
]
_ROUTES = [(methods, re.compile(pattern), kind) for methods, pattern, kind in _ROUTES]


def _route(method: str, path: str) -> tuple[str | None, dict[str, str]]:
    """The kind of a request and its unquoted path parameters."""
    for methods, pattern, kind in _ROUTES:
        if method in methods and (match := pattern.fullmatch(path)):
            return kind, {name: unquote(value) for name, value in match.groupdict().items() if value is not None}
    return None, {}


def git_oid(data: bytes) -> str:
    """The git blob id of `data` (what the Hub calls the oid of a regular file)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    """The pointer file git stores for an LFS file."""
    oid = hashlib.sha256(data).hexdigest()
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {len(data)}\n".encode()


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


@dataclass
class _Commit:
    id: str
    parent: str | None
    message: str
    files: dict[str, bytes]
    lfs: frozenset[str]  # the paths stored through LFS
    date: str = field(default_factory=_now)


@dataclass
class _Repo:
    private: bool
    branches: dict[str, str] = field(default_factory=dict)
    commits: dict[str, _Commit] = field(default_factory=dict)
    created: str = field(default_factory=_now)


class _HttpError(Exception):
    """An error answer: JSON `{"error": message, **extra}` with the X-Error-Message (and X-Error-Code) headers."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None, **extra):
        super().__init__(message)
        headers = {"X-Error-Message": message, **({"X-Error-Code": code} if code else {}), **(headers or {})}
        self.response = _json({"error": message, **extra}, status, headers)


def _json(obj, status: int = 200, headers: dict | None = None, content_type: str = "application/json"):
    return status, {"Content-Type": content_type, **(headers or {})}, json.dumps(obj).encode()


class FakeHub:
    """In-memory Hub on `127.0.0.1:<free port>`; `with FakeHub() as hub:` serves it from a daemon thread."""

    def __init__(self, tokens: set[str] | frozenset[str] = frozenset({"hf_test_token"}), user: str = "test-user"):
        self.tokens, self.user = set(tokens), user
        self.requests: list[tuple[str, str]] = []  # (method, path without query), in arrival order
        self._repos: dict[str, _Repo] = {}
        self._blobs: dict[str, bytes] = {}  # LFS storage, by sha256
        self._pending: dict[str, int] = {}  # LFS uploads announced by the batch API: oid -> size
        self._faults: dict[str, list[int]] = {}  # kind -> [status, remaining times]
        self._counter = 0
        self._lock = threading.RLock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.hub = self
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="FakeHub", daemon=True)
        self._thread.start()

    def __enter__(self) -> "FakeHub":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # Test helpers ---------------------------------------------------------------------------------------------------

    def fail(self, kind: str, status: int, times: int = 1) -> None:
        """Answer the next `times` requests of `kind` (a route kind, e.g. "commit", "lfs_batch") with `status`."""
        if kind not in {route[2] for route in _ROUTES}:
            raise ValueError(f"unknown request kind {kind!r}")
        self._faults[kind] = [status, times]

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """The tree at a branch or commit: {path: content}."""
        with self._lock:
            repo = self._repos[repo_id]
            return dict(repo.commits[self._commit_id(repo, revision)].files)

    def commits(self, repo_id: str, branch: str = "main") -> list[str]:
        """The commit ids of a branch, oldest first."""
        with self._lock:
            repo, ids = self._repos[repo_id], []
            commit_id = repo.branches[branch]
            while commit_id is not None:
                ids.append(commit_id)
                commit_id = repo.commits[commit_id].parent
            return ids[::-1]

    def is_private(self, repo_id: str) -> bool:
        return self._repos[repo_id].private

    def create_repo(self, repo_id: str, private: bool = False, files: dict[str, bytes] | None = None) -> str:
        """Create a repo server-side, optionally with a first commit of `files`; returns the head commit id."""
        with self._lock:
            if repo_id in self._repos:
                raise ValueError(f"{repo_id} exists")
            repo = self._new_repo(repo_id, private)
            if files:
                tree = {**repo.commits[repo.branches["main"]].files, **files}
                lfs = {path for path, data in files.items() if self._is_lfs(tree, path, len(data))}
                self._blobs.update({hashlib.sha256(files[path]).hexdigest(): files[path] for path in lfs})
                self._add_commit(repo, "main", tree, lfs, "Upload files")
            return repo.branches["main"]

    def patch_client(self, monkeypatch, token: str | None = None, cache_dir: str | os.PathLike | None = None) -> None:
        """Point `huggingface_hub` (and so transformers) at this server for the rest of a test.

        Sets the constants read at call time (ENDPOINT, HUGGINGFACE_CO_URL_TEMPLATE), turns offline mode and Xet off,
        re-targets the module-level `huggingface_hub.hf_api.api` and drops the `HfApi` transformers caches. `token`
        becomes the implicit token (`HF_TOKEN`); without it no implicit token is sent. `cache_dir` replaces
        HF_HUB_CACHE.
        """
        import huggingface_hub.hf_api
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "ENDPOINT", self.endpoint)
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", self.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        )
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setattr(huggingface_hub.hf_api.api, "endpoint", self.endpoint)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", os.path.join(tempfile.gettempdir(), "no-such-dir", "token"))
        monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
        if token is None:
            monkeypatch.delenv("HF_TOKEN", raising=False)
        else:
            monkeypatch.setenv("HF_TOKEN", token)
        if cache_dir is not None:
            monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache_dir))
        if "transformers.utils.hub" in sys.modules:
            monkeypatch.setattr(sys.modules["transformers.utils.hub"], "_hf_api", None)

    # Plumbing -------------------------------------------------------------------------------------------------------

    def _handle(self, method: str, target: str, headers, body: bytes):
        url = urlsplit(target)
        self.requests.append((method, url.path))
        kind, args = _route(method, url.path)
        if kind is None:
            return _HttpError(404, f"FakeHub has no route for {method} {url.path}").response
        with self._lock:
            fault = self._faults.get(kind)
            if fault and fault[1] > 0:
                fault[1] -= 1
                return _HttpError(fault[0], f"injected failure of {kind}").response
            auth = headers.get("Authorization", "")
            req = SimpleNamespace(
                body=body,
                query=dict(parse_qsl(url.query)),
                authed=auth.startswith("Bearer ") and auth[len("Bearer ") :] in self.tokens,
            )
            try:
                return getattr(self, f"_on_{kind}")(req, **args)
            except _HttpError as error:
                return error.response

    def _new_repo(self, repo_id: str, private: bool) -> _Repo:
        repo = self._repos[repo_id] = _Repo(private=private)
        self._add_commit(repo, "main", {".gitattributes": GITATTRIBUTES.encode()}, set(), "initial commit")
        return repo

    def _add_commit(self, repo: _Repo, branch: str, files: dict, lfs: set, message: str) -> str:
        self._counter += 1
        parent = repo.branches.get(branch)
        digest = hashlib.sha1(f"{parent}\n{message}\n{self._counter}\n".encode())
        for path in sorted(files):
            digest.update(f"{path}\0{git_oid(files[path])}\n".encode())
        commit = _Commit(digest.hexdigest(), parent, message, files, frozenset(lfs))
        repo.commits[commit.id] = commit
        repo.branches[branch] = commit.id
        return commit.id

    @staticmethod
    def _authenticate(req) -> None:
        if not req.authed:
            raise _HttpError(401, INVALID_TOKEN)

    def _repo(self, repo_id: str, req, write: bool = False) -> _Repo:
        if write:
            self._authenticate(req)
        repo = self._repos.get(repo_id)
        if repo is None or (repo.private and not req.authed):
            # Like the Hub: without a valid token a private repo and a missing one look the same
            raise _HttpError(404 if req.authed else 401, "Repository not found", "RepoNotFound")
        return repo

    def _commit_id(self, repo: _Repo, revision: str) -> str:
        if revision in repo.branches:
            return repo.branches[revision]
        is_oid = re.fullmatch(r"[0-9a-f]{5,40}", revision)  # a commit id or a prefix of one
        matches = [cid for cid in repo.commits if cid.startswith(revision)] if is_oid else []
        if len(matches) != 1:
            raise _HttpError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return matches[0]

    @staticmethod
    def _is_lfs(tree: dict[str, bytes], path: str, size: int) -> bool:
        """What the Hub's preupload answers: LFS above 10 MiB or when the repo's .gitattributes says so."""
        lines = tree.get(".gitattributes", b"").decode().splitlines()
        patterns = [line.split()[0] for line in lines if "filter=lfs" in line.split()]
        name = path if any("/" in pattern for pattern in patterns) else path.rsplit("/", 1)[-1]
        return size > LFS_SIZE_THRESHOLD or any(fnmatch(name, pattern) for pattern in patterns)

    @staticmethod
    def _file_entry(commit: _Commit, path: str) -> dict:
        data = commit.files[path]
        if path not in commit.lfs:
            return {"type": "file", "path": path, "size": len(data), "oid": git_oid(data)}
        pointer = lfs_pointer(data)
        lfs = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": len(pointer)}
        return {"type": "file", "path": path, "size": len(data), "oid": git_oid(pointer), "lfs": lfs}

    # Endpoints ------------------------------------------------------------------------------------------------------

    def _on_create_repo(self, req):
        self._authenticate(req)
        data = json.loads(req.body)
        if data.get("type", "model") != "model":
            raise _HttpError(400, "FakeHub only hosts model repos")
        repo_id = f"{data.get('organization') or self.user}/{data['name']}"
        url = f"{self.endpoint}/{repo_id}"
        if repo_id in self._repos:
            raise _HttpError(409, "You already created this model repo", url=url)  # exist_ok reads the url
        self._new_repo(repo_id, data.get("visibility", "private" if data.get("private") else "public") == "private")
        return _json({"url": url, "name": repo_id, "id": repo_id})

    def _on_whoami(self, req):
        self._authenticate(req)
        auth = {"type": "access_token", "accessToken": {"displayName": "fake-hub-token", "role": "write"}}
        return _json(dict(type="user", name=self.user, fullname=self.user, orgs=[], auth=auth))

    def _on_validate_yaml(self, req):
        return _json({"errors": [], "warnings": []})

    def _on_info(self, req, repo, rev="main"):
        r = self._repo(repo, req)
        commit = r.commits[self._commit_id(r, rev)]
        siblings = [{"rfilename": path} for path in sorted(commit.files)]
        if req.query.get("blobs", "").lower() in ("1", "true"):  # files_metadata=True
            for sibling in siblings:
                entry = self._file_entry(commit, sibling["rfilename"])
                sibling.update(size=entry["size"], blobId=entry["oid"])
                if lfs := entry.get("lfs"):
                    sibling["lfs"] = {"sha256": lfs["oid"], "size": lfs["size"], "pointerSize": lfs["pointerSize"]}
        info = {"_id": commit.id[:24], "id": repo, "modelId": repo, "author": repo.split("/")[0], "sha": commit.id}
        info.update(lastModified=commit.date, createdAt=r.created, private=r.private, gated=False, disabled=False)
        return _json({**info, "downloads": 0, "likes": 0, "tags": [], "siblings": siblings})

    def _on_tree(self, req, repo, rev, path=""):
        r = self._repo(repo, req)
        commit = r.commits[self._commit_id(r, rev)]
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        recursive = req.query.get("recursive", "").lower() in ("1", "true")
        entries = {}
        for file in sorted(commit.files):
            if not file.startswith(prefix):
                continue
            parts = file[len(prefix) :].split("/")
            for depth in range(1, len(parts) if recursive else min(2, len(parts))):
                folder = prefix + "/".join(parts[:depth])
                folder_oid = hashlib.sha1(f"{commit.id}:{folder}".encode()).hexdigest()
                entries[folder] = {"type": "directory", "path": folder, "size": 0, "oid": folder_oid}
            if recursive or len(parts) == 1:
                entries[file] = self._file_entry(commit, file)
        if prefix and not entries:
            raise _HttpError(404, f"{path} does not exist at {rev}", "EntryNotFound", {"X-Repo-Commit": commit.id})
        return _json([entries[key] for key in sorted(entries)])

    def _on_refs(self, req, repo):
        r = self._repo(repo, req)
        branches = [dict(name=name, ref=f"refs/heads/{name}", targetCommit=cid) for name, cid in r.branches.items()]
        return _json({"branches": branches, "converts": [], "tags": [], "pullRequests": []})

    def _on_branch(self, req, repo, branch):
        r = self._repo(repo, req, write=True)
        if branch in r.branches:
            raise _HttpError(409, f"Branch {branch} already exists")
        r.branches[branch] = self._commit_id(r, json.loads(req.body or b"{}").get("startingPoint", "main"))
        return _json({})

    def _on_preupload(self, req, repo, rev):
        r = self._repo(repo, req, write=True)
        commit = r.commits[self._commit_id(r, rev)]
        answers = []
        for file in json.loads(req.body)["files"]:
            path, mode = file["path"], "lfs" if self._is_lfs(commit.files, file["path"], file["size"]) else "regular"
            answer = {"path": path, "uploadMode": mode, "shouldIgnore": False}
            if path in commit.files:
                # The client skips a file whose oid it can reproduce: sha256 for LFS files, git blob id otherwise
                data = commit.files[path]
                answer["oid"] = hashlib.sha256(data).hexdigest() if path in commit.lfs else git_oid(data)
            answers.append(answer)
        return _json({"files": answers, "commitOid": commit.id})

    def _on_commit(self, req, repo, rev):
        r = self._repo(repo, req, write=True)
        if req.query.get("create_pr"):
            raise _HttpError(400, "FakeHub does not support pull requests")
        if rev not in r.branches:
            raise _HttpError(404, f"Invalid rev id: {rev} is not a branch", "RevisionNotFound")
        head = r.branches[rev]
        lines = [json.loads(line) for line in req.body.splitlines() if line.strip()]
        if not lines or lines[0]["key"] != "header":
            raise _HttpError(400, "the first line of a commit must be its header")
        header = lines[0]["value"]
        parent = header.get("parentCommit")
        if parent and not head.startswith(parent):
            raise _HttpError(412, "A commit has happened since. Please refresh and try again.")
        files, lfs = dict(r.commits[head].files), set(r.commits[head].lfs)
        for line in lines[1:]:
            key, value = line["key"], line["value"]
            path = value["path"].strip("/")
            if key == "file":
                content = value["content"]
                files[path] = base64.b64decode(content) if value.get("encoding") == "base64" else content.encode()
                lfs.discard(path)
            elif key == "lfsFile":
                if value["oid"] not in self._blobs:
                    raise _HttpError(422, f"LFS object {value['oid']} of {path} was never uploaded")
                files[path] = self._blobs[value["oid"]]
                lfs.add(path)
            elif key in ("deletedFile", "deletedFolder"):
                doomed = [p for p in files if p == path or (key == "deletedFolder" and p.startswith(path + "/"))]
                if not doomed:
                    raise _HttpError(404, f"{path} does not exist", "EntryNotFound", {"X-Repo-Commit": head})
                for p in doomed:
                    del files[p]
                    lfs.discard(p)
            else:
                raise _HttpError(400, f"unknown commit operation {key!r}")
        oid = self._add_commit(r, rev, files, lfs, header.get("summary", ""))
        url = f"{self.endpoint}/{repo}/commit/{oid}"
        return _json({"success": True, "commitOid": oid, "commitUrl": url, "pullRequestUrl": None})

    def _on_lfs_batch(self, req, repo):
        self._repo(repo, req, write=True)
        data = json.loads(req.body)
        if data.get("operation") != "upload":
            raise _HttpError(400, "FakeHub only supports LFS uploads")
        objects, verify = [], {"href": f"{self.endpoint}/{repo}.git/info/lfs/objects/verify"}
        for obj in data["objects"]:
            answer = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in self._blobs:  # stored objects get no actions: the client skips them
                self._pending[obj["oid"]] = obj["size"]
                answer["actions"] = {"upload": {"href": f"{self.endpoint}/_lfs/{obj['oid']}"}, "verify": verify}
            objects.append(answer)
        # Only "basic" (one plain PUT per object): never "multipart" (a `chunk_size` header) nor "xet"
        return _json({"transfer": "basic", "objects": objects}, content_type="application/vnd.git-lfs+json")

    def _on_lfs_upload(self, req, oid):
        # The upload URL plays a pre-signed storage URL: no Authorization header, but only announced objects
        if self._pending.get(oid) != len(req.body) or hashlib.sha256(req.body).hexdigest() != oid:
            raise _HttpError(400, f"the body is not the announced LFS object {oid}")
        self._blobs[oid] = req.body
        del self._pending[oid]
        return 200, {}, b""

    def _on_lfs_verify(self, req, repo):
        self._repo(repo, req, write=True)
        data = json.loads(req.body)
        blob = self._blobs.get(data["oid"])
        if blob is None or len(blob) != data["size"]:
            raise _HttpError(404, f"LFS object {data['oid']} was not uploaded")
        return _json({"success": True})

    def _on_resolve(self, req, repo, rev, path):
        r = self._repo(repo, req)
        commit = r.commits[self._commit_id(r, rev)]
        if path not in commit.files:
            # With X-Repo-Commit the client caches the absence of the file (".no_exist")
            raise _HttpError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": commit.id})
        entry, data = self._file_entry(commit, path), commit.files[path]
        headers = {"Content-Type": "application/octet-stream", "X-Repo-Commit": commit.id, "ETag": f'"{entry["oid"]}"'}
        if "lfs" in entry:
            headers.update({"X-Linked-Etag": f'"{entry["lfs"]["oid"]}"', "X-Linked-Size": str(len(data))})
        return 200, headers, data


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _serve(self) -> None:
        status, headers, body = self.server.hub._handle(self.command, self.path, self.headers, self._read_body())
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))  # for HEAD: the length the GET would have
        # No keep-alive: a pooled connection to a closed FakeHub must not serve a later one on the same port
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_POST = do_PUT = _serve

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() != "chunked":
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))
        chunks = []  # streamed uploads (file objects) may come chunked
        while size := int(self.rfile.readline().split(b";")[0], 16):
            chunks.append(self.rfile.read(size))
            self.rfile.readline()
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
            pass  # trailers
        return b"".join(chunks)

    def log_message(self, format, *args) -> None:
        pass
