"""A local HTTP stand-in for the Hugging Face Hub, for tests.

`HubServer` serves ``<root>/<owner>/<name>/<files>`` as model repos to the real
``huggingface_hub`` client (point ``HF_ENDPOINT`` at ``server.url``). It answers
the endpoints that client calls:

- ``GET /api/models/{repo}[/revision/{rev}]``            model_info / repo_info
- ``GET /api/models/{repo}/tree/{rev}[/{path}]``         list_repo_tree / list_repo_files
- ``POST /api/models/{repo}/paths-info/{rev}``           get_paths_info
- ``HEAD|GET /{repo}/resolve/{rev}/{filename}``          hf_hub_download / get_hf_file_metadata

Files are served straight (no CDN redirect) and never with Xet headers, so the
client always downloads over plain HTTP. The revision is ``main`` or the repo's
fake commit sha, a sha1 of its file list. Faults are injected per request via
``server.faults`` (see `Faults`); every request is recorded in ``server.log``.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from fnmatch import fnmatchcase
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

# Files stored with Git LFS on the stand-in: they get an `lfs` entry (sha256) in the API and
# their sha256 as ETag, like on the Hub. Everything else is a plain git blob (ETag = blob sha1).
LFS_SUFFIXES = (".gguf", ".bin", ".safetensors", ".pt", ".pth", ".onnx", ".npz", ".zip", ".tar")
CHUNK = 64 * 1024
TREE_PAGE_SIZE = 1000  # the Hub's page size for /tree (50 with expand=true)

_ROUTES = [
    ("info", re.compile(r"^/api/models/([^/]+/[^/]+)$")),
    ("info", re.compile(r"^/api/models/([^/]+/[^/]+)/revision/([^/]+)$")),
    ("tree", re.compile(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?$")),
    ("paths", re.compile(r"^/api/models/([^/]+/[^/]+)/paths-info/([^/]+)$")),
    ("resolve", re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")),
]


# --- repo contents -------------------------------------------------------------------------


@dataclass(frozen=True)
class FileInfo:
    """What the Hub knows about one file of a repo."""

    path: str  # path in the repo, "/"-separated
    size: int
    oid: str  # git blob sha1 (of the LFS pointer, for LFS files)
    sha256: str | None  # LFS files only
    pointer_size: int | None  # LFS files only

    @property
    def etag(self) -> str:
        return self.sha256 or self.oid


def _git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _hash_file(path: Path, algo: str) -> str:
    h = hashlib.new(algo)
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _file_info(path: Path, rel: str) -> FileInfo:
    size = path.stat().st_size
    if not rel.lower().endswith(LFS_SUFFIXES):
        h = hashlib.sha1(b"blob %d\0" % size)
        h.update(path.read_bytes())
        return FileInfo(rel, size, h.hexdigest(), None, None)
    sha = _hash_file(path, "sha256")
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {size}\n".encode()
    return FileInfo(rel, size, _git_blob_oid(pointer), sha, len(pointer))


# --- faults --------------------------------------------------------------------------------


@dataclass
class Fault:
    """One injected fault; `pattern` is an fnmatch glob on "owner/name" or "owner/name/path"."""

    kind: str  # not_found | unauthorized | server_error | drop | corrupt | throttle
    pattern: str
    times: int | None = None  # fires on this many matching requests, then is spent; None: always
    method: str | None = None  # only requests with this method (HEAD, GET, POST); None: all
    after_bytes: int = 0  # drop: body bytes sent before the connection is cut
    offset: int = 0  # corrupt: file offset of the byte flipped
    status: int = 500  # server_error
    token: str | None = None  # unauthorized: the token that gets through
    gated: bool = False  # unauthorized: answer as a gated repo instead of a private one
    bytes_per_s: float = 0.0  # throttle
    fired: int = 0

    def matches(self, method: str, repo_id: str, target: str) -> bool:
        if self.times is not None and self.fired >= self.times:
            return False
        if self.method is not None and self.method != method:
            return False
        return fnmatchcase(repo_id, self.pattern) or fnmatchcase(target, self.pattern)


class Faults:
    """The faults of a running server; all methods are thread-safe and return the `Fault`.

    A pattern naming a repo ("owner/name", "owner/*") hits every request on that repo
    (API and file); a pattern naming a file ("owner/name/*.gguf") hits only that file's
    /resolve requests. `times` counts matching requests the fault fires on.

        hub.faults.drop("acme/tiny/*.gguf", after_bytes=100_000)        # cut once, mid-body
        hub.faults.corrupt("acme/tiny/model.gguf", offset=4096)           # flipped byte, every GET
        hub.faults.not_found("acme/tiny")                                 # RepositoryNotFoundError
        hub.faults.unauthorized("acme/tiny", token="hf_ok", gated=True)   # GatedRepoError unless hf_ok
        hub.faults.server_error("acme/tiny", times=2)                     # two 500s, then fine
        fault = hub.faults.throttle("acme/*", bytes_per_s=50_000); hub.faults.remove(fault)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: list[Fault] = []

    def add(self, kind: str, pattern: str, **params) -> Fault:
        fault = Fault(kind, pattern, **params)
        with self._lock:
            self._faults.append(fault)
        return fault

    def not_found(self, pattern: str, **kw) -> Fault:
        """404 RepoNotFound when `pattern` matches the repo id, else 404 EntryNotFound."""
        return self.add("not_found", pattern, **kw)

    def unauthorized(self, pattern: str, token: str | None = None, gated: bool = False, **kw) -> Fault:
        """401 (private: RepoNotFound; gated: GatedRepo) unless "Bearer <token>" is sent."""
        return self.add("unauthorized", pattern, token=token, gated=gated, **kw)

    def server_error(self, pattern: str, times: int | None = 1, status: int = 500, **kw) -> Fault:
        """Answer `status` to the next `times` matching requests, then recover."""
        return self.add("server_error", pattern, times=times, status=status, **kw)

    def drop(self, pattern: str, after_bytes: int, times: int | None = 1) -> Fault:
        """Cut the connection after `after_bytes` bytes of a GET body (counted per response).

        `times` counts matching GETs, also those whose body is shorter than `after_bytes`."""
        return self.add("drop", pattern, after_bytes=after_bytes, times=times, method="GET")

    def corrupt(self, pattern: str, offset: int, times: int | None = None) -> Fault:
        """Flip (xor 0xFF) the byte at file offset `offset` in GET bodies covering it."""
        return self.add("corrupt", pattern, offset=offset, times=times, method="GET")

    def throttle(self, pattern: str, bytes_per_s: float, times: int | None = None) -> Fault:
        """Send GET bodies at about `bytes_per_s`."""
        return self.add("throttle", pattern, bytes_per_s=bytes_per_s, times=times, method="GET")

    def remove(self, fault: Fault) -> None:
        with self._lock:
            self._faults = [f for f in self._faults if f is not fault]

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def __len__(self) -> int:
        return len(self._faults)

    def take(self, kinds: tuple[str, ...], method: str, repo_id: str, target: str, auth: str | None) -> list[Fault]:
        """The live faults of `kinds` for this request, each counted as fired once."""
        with self._lock:
            hits = [f for f in self._faults if f.kind in kinds and f.matches(method, repo_id, target)]
            hits = [f for f in hits if not (f.kind == "unauthorized" and f.token and auth == f"Bearer {f.token}")]
            for f in hits:
                f.fired += 1
            return hits


# --- request log ---------------------------------------------------------------------------


@dataclass
class Request:
    """One request as the server saw it."""

    method: str
    path: str  # unquoted URL path, without query
    query: str
    range: str | None
    authorization: str | None
    status: int | None = None
    bytes_sent: int = 0  # body bytes written (less than announced when dropped)
    dropped: bool = False  # cut by a `drop` fault
    finished: bool = False  # the server is done with it (the client may still be reading)


# --- HTTP handling -------------------------------------------------------------------------


class _HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None,
                 size: int | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.commit, self.size = status, code, message, commit, size


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and Content-Length framing, as the Hub
    server: _Server
    entry: Request

    def log_message(self, format: str, *args) -> None:  # keep test output clean
        pass

    def send_response(self, code: int, message: str | None = None) -> None:
        self.entry.status = code
        super().send_response(code, message)

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == "/api/agent-harnesses":  # the client's user-agent probe, once per process: not logged
            self.entry = Request(self.command, url.path, "", None, None)
            return self._send_json({"standardEnvVars": [], "harnesses": {}})
        self.entry = Request(self.command, unquote(url.path), url.query,
                             self.headers.get("Range"), self.headers.get("Authorization"))
        self.server.hub.log.append(self.entry)
        try:
            self._dispatch(url.path, url.query)
        except _HubError as e:
            self._send_error(e)
        except (BrokenPipeError, ConnectionResetError):  # the client went away mid-body
            self.close_connection = True
        finally:
            self.entry.finished = True

    do_HEAD = do_POST = do_GET

    def _dispatch(self, raw_path: str, query: str) -> None:
        hub = self.server.hub
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if self.command == "POST" else b""
        route = next(((kind, m) for kind, regex in _ROUTES if (m := regex.match(raw_path))), None)
        if route is None:
            raise _HubError(404, None, f"no route for {raw_path}")
        kind, m = route
        groups = [unquote(g or "") for g in m.groups()] + ["", ""]
        repo_id, rev, sub = groups[0], groups[1] or "main", groups[2]
        target = f"{repo_id}/{sub}" if kind == "resolve" else repo_id
        self._apply_response_faults(repo_id, target, hub.repo_dir(repo_id).is_dir())
        files, commit = hub.check_revision(repo_id, rev)
        if kind == "info":
            self._send_json(hub.model_info(repo_id, files, commit, blobs="blobs=true" in query.lower()))
        elif kind == "tree":
            self._send_tree(repo_id, rev, sub, parse_qs(query), files)
        elif kind == "paths":
            paths = parse_qs(body.decode()).get("paths", [])
            self._send_json([e for p in paths for e in _tree_entries(files, p, exact=True)])
        else:
            self._send_file(hub.repo_dir(repo_id), files, commit, sub, target, repo_id)

    def _apply_response_faults(self, repo_id: str, target: str, repo_exists: bool) -> None:
        hits = self.server.hub.faults.take(("not_found", "unauthorized", "server_error"), self.command,
                                           repo_id, target, self.headers.get("Authorization"))
        if not hits:
            return
        f = hits[0]
        commit = self.server.hub.commit(repo_id) if repo_exists else None
        if f.kind == "not_found" and fnmatchcase(repo_id, f.pattern):
            raise _HubError(404, "RepoNotFound", "Repository not found")
        if f.kind == "not_found":
            raise _HubError(404, "EntryNotFound", "Entry not found", commit)
        if f.kind == "server_error":
            raise _HubError(f.status, None, "Internal Error (injected)")
        # Same answers as the Hub: no token -> 401 with a code the client maps to
        # RepositoryNotFoundError / GatedRepoError; a wrong token -> invalid credentials.
        if self.headers.get("Authorization") is None:
            code = "GatedRepo" if f.gated else "RepoNotFound"
            raise _HubError(401, code, "Access to this repo is restricted. Please log in.")
        if f.gated:
            raise _HubError(403, "GatedRepo", f"Access to model {repo_id} is restricted.")
        raise _HubError(401, None, "Invalid credentials in Authorization header")

    def _send_error(self, e: _HubError) -> None:
        body = b"" if self.command == "HEAD" else json.dumps({"error": e.message}).encode()
        self.send_response(e.status)
        if e.code:
            self.send_header("X-Error-Code", e.code)
        self.send_header("X-Error-Message", e.message)
        if e.commit:
            self.send_header("X-Repo-Commit", e.commit)  # lets the client cache "no such file" (.no_exist)
        if e.size is not None:
            self.send_header("Content-Range", f"bytes */{e.size}")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send_json(self, data: object, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(data).encode()
        self.send_response(200)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send_tree(self, repo_id: str, rev: str, prefix: str, q: dict, files: dict[str, FileInfo]) -> None:
        """One page of /tree; the client follows the `Link: <...>; rel="next"` header."""
        recursive = q.get("recursive", ["false"])[0].lower() == "true"
        if prefix and not any(p.startswith(prefix.rstrip("/") + "/") for p in files):
            raise _HubError(404, "EntryNotFound", f"{prefix} does not exist on {rev}")
        entries = _tree_entries(files, prefix, recursive=recursive)
        expand = q.get("expand", ["false"])[0].lower() == "true"
        size = self.server.hub.tree_page_size or (50 if expand else TREE_PAGE_SIZE)
        start = int(q.get("cursor", ["0"])[0])
        headers = {}
        if start + size < len(entries):
            path = f"/api/models/{repo_id}/tree/{quote(rev, safe='')}" + (prefix and "/" + quote(prefix, safe=""))
            flags = f"recursive={str(recursive).lower()}&expand={str(expand).lower()}"
            nxt = f"{self.server.hub.url}{path}?{flags}&cursor={start + size}"
            headers["Link"] = f'<{nxt}>; rel="next"'
        self._send_json(entries[start:start + size], headers)

    def _send_file(self, repo_dir: Path, files: dict[str, FileInfo], commit: str, name: str,
                   target: str, repo_id: str) -> None:
        info = files.get(name)
        if info is None:
            raise _HubError(404, "EntryNotFound", f"{name} does not exist", commit)
        start, end = 0, info.size
        status = 200
        if self.command == "GET" and (rng := self.headers.get("Range")):
            start, end = _parse_range(rng, info.size)
            status = 206
        self.send_response(status)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", f'"{info.etag}"')
        if info.sha256:  # the Hub sends these for LFS files; the client prefers them over ETag/Content-Length
            self.send_header("X-Linked-Etag", f'"{info.sha256}"')
            self.send_header("X-Linked-Size", str(info.size))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{info.size}")
        self.end_headers()
        if self.command == "GET":
            faults = self.server.hub.faults.take(("drop", "corrupt", "throttle"), "GET", repo_id, target, None)
            self._send_body(repo_dir / name, start, end, faults)

    def _send_body(self, path: Path, start: int, end: int, faults: list[Fault]) -> None:
        drop = min((f.after_bytes for f in faults if f.kind == "drop"), default=None)
        flips = [f.offset for f in faults if f.kind == "corrupt"]
        rate = min((f.bytes_per_s for f in faults if f.kind == "throttle"), default=0.0)
        chunk = max(1, min(CHUNK, int(rate / 20))) if rate else CHUNK
        pos = start
        with open(path, "rb") as fh:
            fh.seek(start)
            while pos < end and not self.server.stopping.is_set():
                n = min(chunk, end - pos)
                if drop is not None:
                    n = min(n, drop - self.entry.bytes_sent)
                    if n <= 0:
                        break
                data = bytearray(fh.read(n))
                for off in flips:
                    if pos <= off < pos + len(data):
                        data[off - pos] ^= 0xFF
                self.wfile.write(data)
                pos += len(data)
                self.entry.bytes_sent += len(data)
                if rate:
                    time.sleep(len(data) / rate)
        if pos < end:  # cut: the client sees fewer bytes than Content-Length
            self.entry.dropped = True
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)


def _parse_range(header: str, size: int) -> tuple[int, int]:
    """(start, end-exclusive) of a single "bytes=a-b" / "bytes=a-" / "bytes=-n" range."""
    m = re.fullmatch(r"bytes=(\d*)-(\d*)", header.strip())
    if not m or m.groups() == ("", ""):
        raise _HubError(416, None, f"bad range {header!r}")
    a, b = m.groups()
    start, end = (max(0, size - int(b)), size) if a == "" else (int(a), min(size, int(b) + 1) if b else size)
    if start >= size or start >= end:
        raise _HubError(416, None, f"range {header!r} not satisfiable for size {size}", size=size)
    return start, end


def _tree_entries(files: dict[str, FileInfo], prefix: str, recursive: bool = False,
                  exact: bool = False) -> list[dict]:
    """/tree (children of `prefix`) or /paths-info (`prefix` itself) entries, sorted by path."""
    prefix = prefix.strip("/")
    folders: set[str] = set()
    out = []
    for p, info in files.items():
        parts = p.split("/")
        for i in range(1, len(parts)):
            folders.add("/".join(parts[:i]))
        if p == prefix if exact else _is_child(p, prefix, recursive):
            entry = {"type": "file", "oid": info.oid, "size": info.size, "path": p}
            if info.sha256:
                entry["lfs"] = {"oid": info.sha256, "size": info.size, "pointerSize": info.pointer_size}
            out.append(entry)
    for d in folders:
        if d == prefix if exact else _is_child(d, prefix, recursive):
            oid = hashlib.sha1("\n".join(p for p in files if p.startswith(d + "/")).encode()).hexdigest()
            out.append({"type": "directory", "oid": oid, "size": 0, "path": d})
    return sorted(out, key=lambda e: e["path"])


def _is_child(path: str, prefix: str, recursive: bool) -> bool:
    if prefix and not path.startswith(prefix + "/"):
        return False
    rest = path[len(prefix) + 1:] if prefix else path
    return recursive or "/" not in rest


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    hub: HubServer
    stopping: threading.Event

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # client hang-ups are expected here
            super().handle_error(request, client_address)


# --- the server ----------------------------------------------------------------------------


class HubServer:
    """A Hub stand-in on 127.0.0.1 (free port) serving `root` in a background thread.

    >>> with HubServer() as hub:
    ...     hub.add_repo("acme/tiny", {"model-Q4_K_M.gguf": b"GGUF...", "README.md": "hi"})
    ...     # HF_ENDPOINT=hub.url ; hf_hub_download("acme/tiny", "model-Q4_K_M.gguf")
    """

    def __init__(self, root: str | Path | None = None) -> None:
        self._own_root = root is None
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="hubserver-"))
        self.faults = Faults()
        self.log: list[Request] = []
        self.tree_page_size: int | None = None  # None: the Hub's sizes (1000, or 50 with expand)
        self._cache: dict[tuple[str, int, int], FileInfo] = {}
        self._lock = threading.Lock()
        self._httpd: _Server | None = None

    # lifecycle
    def start(self) -> HubServer:
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.hub = self
        self._httpd.stopping = threading.Event()
        threading.Thread(target=self._httpd.serve_forever, name="hubserver", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.stopping.set()  # ends throttled bodies still being sent
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._httpd is not None, "server not started"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def reset(self, root: str | Path | None = None) -> None:
        """Clear faults and the request log; optionally serve another root folder."""
        self.faults.clear()
        self.log.clear()
        self.tree_page_size = None
        if root is not None:
            self.root = Path(root)

    # repos
    def repo_dir(self, repo_id: str) -> Path:
        return self.root.joinpath(*repo_id.split("/"))

    def add_repo(self, repo_id: str, files: dict[str, bytes | str | Path]) -> str:
        """Publish files (bytes, text, or a source file, symlinked) into a repo; returns its commit."""
        for rel, src in files.items():
            dst = self.repo_dir(repo_id).joinpath(*rel.split("/"))
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.unlink(missing_ok=True)
            if isinstance(src, Path):
                dst.symlink_to(src.resolve())
            else:
                dst.write_bytes(src.encode() if isinstance(src, str) else src)
        return self.commit(repo_id)

    def files(self, repo_id: str) -> dict[str, FileInfo]:
        """The repo's files by path in the repo (hashes cached by size and mtime)."""
        base = self.repo_dir(repo_id)
        out = {}
        for path in sorted(base.rglob("*")):
            rel = path.relative_to(base).as_posix()
            if ".git" in rel.split("/") or not path.is_file():
                continue
            st = path.stat()
            key = (str(path), st.st_size, st.st_mtime_ns)
            with self._lock:
                info = self._cache.get(key)
            if info is None:
                info = _file_info(path, rel)
                with self._lock:
                    self._cache[key] = info
            out[rel] = info
        return out

    def commit(self, repo_id: str) -> str:
        """The repo's fake commit sha: changes whenever a file is added, removed or changed."""
        return _commit_of(self.files(repo_id))

    def check_revision(self, repo_id: str, revision: str) -> tuple[dict[str, FileInfo], str]:
        if not self.repo_dir(repo_id).is_dir():
            raise _HubError(404, "RepoNotFound", f"Repository {repo_id} not found")
        files = self.files(repo_id)
        commit = _commit_of(files)
        if revision not in ("main", commit):
            raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return files, commit

    def model_info(self, repo_id: str, files: dict[str, FileInfo], commit: str, blobs: bool) -> dict:
        """The /api/models/{repo} body; sizes and LFS info only with ?blobs=true (files_metadata)."""
        siblings = []
        for info in files.values():
            s: dict = {"rfilename": info.path}
            if blobs:
                s.update(size=info.size, blobId=info.oid)
                if info.sha256:
                    s["lfs"] = {"sha256": info.sha256, "size": info.size, "pointerSize": info.pointer_size}
            siblings.append(s)
        mtime = max((self.repo_dir(repo_id).joinpath(p).stat().st_mtime for p in files), default=0)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(mtime))
        return {
            "_id": commit[:24], "id": repo_id, "author": repo_id.split("/")[0], "sha": commit,
            "lastModified": stamp, "createdAt": stamp, "private": False, "gated": False,
            "disabled": False, "downloads": 0, "likes": 0,
            "tags": ["gguf"] if any(p.endswith(".gguf") for p in files) else [],
            "siblings": siblings, "usedStorage": sum(i.size for i in files.values()),
        }

    # request log
    def requests(self, method: str | None = None, path: str = "*") -> list[Request]:
        """Logged requests, filtered by method and an fnmatch glob on the unquoted path."""
        return [r for r in list(self.log) if (method is None or r.method == method) and fnmatchcase(r.path, path)]

    def count(self, method: str | None = None, path: str = "*") -> int:
        return len(self.requests(method, path))

    def file_path(self, repo_id: str, filename: str, revision: str = "main") -> str:
        """The /resolve path of a file, as logged (for `requests(path=...)`)."""
        return f"/{repo_id}/resolve/{revision}/{filename}"


def _commit_of(files: dict[str, FileInfo]) -> str:
    return hashlib.sha1("".join(f"{p}\0{i.oid}\n" for p, i in files.items()).encode()).hexdigest()


__all__ = ["LFS_SUFFIXES", "Fault", "Faults", "FileInfo", "HubServer", "Request"]
