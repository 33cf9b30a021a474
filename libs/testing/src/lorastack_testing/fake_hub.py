"""A model hub on loopback that speaks what `huggingface_hub` asks of the real one.

Serves folders the tests make as repos `OWNER/NAME`, each at one commit sha, through two
servers, as the real hub does (the hub, and a CDN on another origin for LFS files):

    GET  /api/models/{repo}/revision/{rev}[?blobs=true]   model info: id, sha, siblings
                                                          (size, blobId, lfs sha256/size)
    GET  /api/models/{repo}/tree/{rev}[/{dir}]            tree entries (type, oid, size,
         ?recursive=&cursor=                              path, lfs), `page_size` a page,
                                                          the next page in a Link header
    POST /api/models/{repo}/paths-info/{rev}              entries of the form's `paths`
    HEAD|GET /{repo}/resolve/{rev}/{path}                 X-Repo-Commit and ETag (git blob
                                                          sha1); LFS files (*.safetensors,
                                                          *.bin, ...) answer 302 to the CDN
                                                          with X-Linked-Etag (sha256) and
                                                          X-Linked-Size
    HEAD|GET {cdn}/cdn/{repo}/-/{path}                    the bytes; Range answers 206, a
                                                          range past the end 416

with the real hub's error shapes (401 `X-Error-Code: GatedRepo` without the token, 404 with
`RepoNotFound | RevisionNotFound | EntryNotFound`). `cut_once[path] = N` sends only the first
N bytes of that file once and drops the connection, to test resuming; `cdn_status[path] =
S` has the CDN answer S for that file every time (a download that finally fails). Every
request is
recorded (`requests`: method, path, Range header); `cdn_authorization` keeps any
Authorization header the CDN was sent (a token must never leave the hub). `page_size` makes
the tree listing span pages; `barrier` holds model-info requests until N have arrived.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pth", ".gguf")
POINTER_SIZE = 134  # bytes of a git-lfs pointer file, as the hub reports it


@dataclass
class Repo:
    """One repo of the fake hub: its folder, commit sha, token (gated) and branches."""

    folder: Path
    commit: str  # 40 hex
    token: str | None = None  # gated: requests need "Authorization: Bearer TOKEN"
    branches: tuple[str, ...] = ("main",)


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeHub:
    """The fake hub and its CDN: the repos it serves, the failures a test sets up, and the
    requests it received."""

    host: str = "127.0.0.1"
    repos: dict[str, Repo] = field(default_factory=dict)
    cut_once: dict[str, int] = field(default_factory=dict)
    cdn_status: dict[str, int] = field(default_factory=dict)  # path -> status, every time
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    cdn_authorization: list[str] = field(default_factory=list)
    page_size: int = 1000  # tree entries per page (the real hub: 1,000)
    # set: each model-info request waits there until the barrier's parties have all sent
    # one (two imports that the test wants in flight at once)
    barrier: threading.Barrier | None = None
    _server: ThreadingHTTPServer | None = None
    _cdn: ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://{self.host}:{self._server.server_address[1]}"

    @property
    def cdn_url(self) -> str:
        assert self._cdn is not None
        return f"http://{self.host}:{self._cdn.server_address[1]}"

    @property
    def port(self) -> int:
        return self._port(self._server)

    @staticmethod
    def _port(server: ThreadingHTTPServer | None) -> int:
        assert server is not None
        return int(server.server_address[1])

    def add(self, repo_id: str, folder: Path, token: str | None = None) -> Repo:
        """Serve `folder` as the repo `repo_id` (gated when `token` is given) at a fixed sha."""
        commit = hashlib.sha1(f"{repo_id}:{folder}".encode()).hexdigest()
        repo = self.repos[repo_id] = Repo(folder, commit, token)
        return repo

    def start(self, port: int = 0) -> FakeHub:
        """Start the hub (on `port`, 0: any free one) and its CDN; returns self."""
        self._server = self._serve(port, self._handle)
        self._cdn = self._serve(0, self._handle_cdn)
        return self

    def _serve(self, port: int, handle: object) -> ThreadingHTTPServer:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the library's client expects

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                handle(self, False)  # type: ignore[operator]

            def do_GET(self) -> None:
                handle(self, True)  # type: ignore[operator]

            def do_POST(self) -> None:
                handle(self, True)  # type: ignore[operator]

        server = ThreadingHTTPServer((self.host, port), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    def stop(self) -> None:
        """Shut both servers down."""
        for server in (self._server, self._cdn):
            if server is not None:
                server.shutdown()
                server.server_close()

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the hub ----------------------------------------------------------------------

    def _record(self, h: BaseHTTPRequestHandler, path: str) -> None:
        with self._lock:
            self.requests.append((h.command, path, h.headers.get("range")))

    def _handle(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        split = urlsplit(h.path)
        path, query = unquote(split.path), parse_qs(split.query)
        self._record(h, path)
        if path.startswith("/api/models/"):
            return self._api(h, path.removeprefix("/api/models/"), query)
        owner, name, kind, rev, rel = (path.lstrip("/").split("/", 4) + [""] * 5)[:5]
        repo_id = f"{owner}/{name}"
        repo = self._authorised(h, repo_id)
        if repo is None:
            return
        if kind != "resolve" or rev not in (repo.commit, *repo.branches):
            return _error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
        file = repo.folder / rel
        if not rel or not file.is_file():
            return _error(h, 404, "EntryNotFound", f"{rel} does not exist", repo.commit)
        data = file.read_bytes()
        if rel.endswith(LFS_SUFFIXES):  # the real hub sends LFS files to a CDN
            h.send_response(302)
            cdn = _origin(h, self._port(self._cdn))  # the name the client used, CDN's port
            h.send_header("location", f"{cdn}/cdn/{repo_id}/-/{quote(rel)}")
            h.send_header("x-repo-commit", repo.commit)
            h.send_header("x-linked-etag", f'"{hashlib.sha256(data).hexdigest()}"')
            h.send_header("x-linked-size", str(len(data)))
            h.send_header("etag", f'"{_git_blob_sha1(data)}"')
            h.send_header("content-length", "0")
            h.end_headers()
            return
        self._send_bytes(h, data, rel, body, {"x-repo-commit": repo.commit,
                                              "etag": f'"{_git_blob_sha1(data)}"'})  # fmt: skip

    def _api(self, h: BaseHTTPRequestHandler, rest: str, query: dict[str, list[str]]) -> None:
        for route in ("/revision/", "/tree/", "/paths-info/"):
            repo_id, found, tail = rest.partition(route)
            if found:
                break
        else:
            return _error(h, 404, "RepoNotFound", "Repository not found")
        repo = self._authorised(h, repo_id)
        if repo is None:
            return
        rev, _, sub = tail.partition("/")
        if rev not in (repo.commit, *repo.branches):
            return _error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
        if route == "/revision/":
            if self.barrier is not None:
                self.barrier.wait()
            return _json(h, self._info(repo_id, repo))
        if route == "/paths-info/":
            length = int(h.headers.get("content-length", 0))
            form = parse_qs(h.rfile.read(length).decode())
            wanted = set(form.get("paths", []))
            return _json(h, [e for e in self._entries(repo, "", True) if e["path"] in wanted])
        entries = self._entries(repo, sub, query.get("recursive", ["false"])[0] == "True")
        start = int(query.get("cursor", ["0"])[0])
        page = entries[start : start + self.page_size]
        link = None
        if start + self.page_size < len(entries):
            nxt = f"{_origin(h, self.port)}/api/models/{repo_id}/tree/{rev}" + (
                f"/{sub}" if sub else ""
            )
            link = f'<{nxt}?recursive={query.get("recursive", ["false"])[0]}&cursor={start + self.page_size}>; rel="next"'
        return _json(h, page, {"link": link} if link else {})

    def _authorised(self, h: BaseHTTPRequestHandler, repo_id: str) -> Repo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            _error(h, 404, "RepoNotFound", "Repository not found")
            return None
        if repo.token and h.headers.get("authorization") != f"Bearer {repo.token}":
            _error(h, 401, "GatedRepo", f"Access to model {repo_id} is restricted.")
            return None
        return repo

    def _files(self, repo: Repo) -> list[tuple[str, bytes]]:
        return [
            (p.relative_to(repo.folder).as_posix(), p.read_bytes())
            for p in sorted(repo.folder.rglob("*"))
            if p.is_file()
        ]

    def _info(self, repo_id: str, repo: Repo) -> dict[str, object]:
        siblings = []
        for rel, data in self._files(repo):
            entry: dict[str, object] = {
                "rfilename": rel, "size": len(data), "blobId": _git_blob_sha1(data),
            }  # fmt: skip
            if rel.endswith(LFS_SUFFIXES):
                entry["lfs"] = {
                    "sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                    "pointerSize": POINTER_SIZE,
                }  # fmt: skip
            siblings.append(entry)
        return {"id": repo_id, "sha": repo.commit, "gated": bool(repo.token), "siblings": siblings}

    def _entries(self, repo: Repo, under: str, recursive: bool) -> list[dict[str, object]]:
        prefix = under.strip("/") + "/" if under.strip("/") else ""
        entries: dict[str, dict[str, object]] = {}
        for rel, data in self._files(repo):
            if not rel.startswith(prefix):
                continue
            parts = rel[len(prefix) :].split("/")
            for depth in range(1, len(parts)):  # the folders on the way
                folder = prefix + "/".join(parts[:depth])
                if recursive or depth == 1:
                    entries.setdefault(folder, {"type": "directory", "oid": "0" * 40,
                                                "size": 0, "path": folder})  # fmt: skip
            if not recursive and len(parts) > 1:
                continue
            entry: dict[str, object] = {
                "type": "file", "oid": _git_blob_sha1(data), "size": len(data), "path": rel,
            }  # fmt: skip
            if rel.endswith(LFS_SUFFIXES):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                                "pointerSize": POINTER_SIZE}  # fmt: skip
            entries[rel] = entry
        return sorted(entries.values(), key=lambda e: str(e["path"]))

    # -- the CDN ----------------------------------------------------------------------

    def _handle_cdn(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self._record(h, path)
        if h.headers.get("authorization"):
            with self._lock:
                self.cdn_authorization.append(h.headers["authorization"])
        repo_id, _, rel = path.removeprefix("/cdn/").partition("/-/")
        if rel in self.cdn_status:
            return _error(h, self.cdn_status[rel], "ServiceUnavailable", "the CDN is down")
        repo = self.repos.get(repo_id)
        file = repo.folder / rel if repo is not None else None
        if file is None or not file.is_file():
            return _error(h, 404, "EntryNotFound", "no such object")
        data = file.read_bytes()
        self._send_bytes(h, data, rel, body, {"etag": f'"{hashlib.sha256(data).hexdigest()}"'})

    def _send_bytes(
        self, h: BaseHTTPRequestHandler, data: bytes, rel: str, body: bool, headers: dict[str, str]
    ) -> None:
        start = 0
        rng = h.headers.get("range")
        if rng and rng.startswith("bytes="):
            start = int(rng.removeprefix("bytes=").split("-")[0])
            if start >= len(data):
                return _error(h, 416, "RangeNotSatisfiable", "range not satisfiable")
            h.send_response(206)
            h.send_header("content-range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            h.send_response(200)
        h.send_header("content-length", str(len(data) - start))
        for k, v in headers.items():
            h.send_header(k, v)
        h.end_headers()
        if not body:
            return
        with self._lock:
            cut = self.cut_once.pop(rel, None)
        if cut is not None:  # a broken connection mid-file
            h.wfile.write(data[start:cut])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)
            return
        h.wfile.write(data[start:])


def _origin(h: BaseHTTPRequestHandler, port: int) -> str:
    """http://HOST:port, HOST as the client named this server (e.g. host.docker.internal)."""
    host = urlsplit(f"//{h.headers.get('host', '127.0.0.1')}").hostname or "127.0.0.1"
    return f"http://{host}:{port}"


def _json(h: BaseHTTPRequestHandler, obj: object, headers: dict[str, str] | None = None) -> None:
    raw = json.dumps(obj).encode()
    h.send_response(200)
    h.send_header("content-type", "application/json")
    h.send_header("content-length", str(len(raw)))
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    h.end_headers()
    h.wfile.write(raw)


def _error(
    h: BaseHTTPRequestHandler, status: int, code: str, message: str, commit: str | None = None
) -> None:
    raw = json.dumps({"error": message}).encode()
    h.send_response(status)
    h.send_header("x-error-code", code)
    h.send_header("x-error-message", message)
    if commit:
        h.send_header("x-repo-commit", commit)
    h.send_header("content-type", "application/json")
    h.send_header("content-length", str(len(raw)))
    h.end_headers()
    if h.command != "HEAD":
        h.wfile.write(raw)


def make_tiny_model(folder: Path) -> Path:
    """A real (random, tiny) Llama with a word-level tokenizer and a ChatML template."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<|im_start|>", "<|im_end|>", "<unk>", "user", "assistant", "system"]
    words += [f"w{i}" for i in range(58)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>",
        unk_token="<unk>", pad_token="<|im_end|>", model_max_length=512,
    )  # fmt: skip
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
