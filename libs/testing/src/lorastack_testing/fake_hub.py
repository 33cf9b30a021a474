"""A model hub on loopback that speaks the download protocol `lorastack model import` uses.

Serves folders the tests make as repos `OWNER/NAME`, each at one commit sha:

    GET /api/models/{repo}/revision/{rev}?blobs=true   listing: sha, siblings (size, lfs)
    GET|HEAD /{repo}/resolve/{rev}/{path}              files; LFS files (*.safetensors,
                                                       *.bin) redirect to /cdn/... like the
                                                       real hub; Range requests answer 206

with the real hub's error shapes (401 for a gated repo without the token, 404 with
`X-Error-Code: RepoNotFound | RevisionNotFound`). `cut_once[path] = N` sends only the first
N bytes of that file once and drops the connection, to test resuming. Every request is
recorded (`requests`: method, path, Range header).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pth", ".gguf")


@dataclass
class Repo:
    folder: Path
    commit: str  # 40 hex
    token: str | None = None  # gated: requests need "Authorization: Bearer TOKEN"
    branches: tuple[str, ...] = ("main",)


@dataclass
class FakeHub:
    host: str = "127.0.0.1"
    repos: dict[str, Repo] = field(default_factory=dict)
    cut_once: dict[str, int] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://{self.host}:{self._server.server_address[1]}"

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.server_address[1])

    def add(self, repo_id: str, folder: Path, token: str | None = None) -> Repo:
        commit = hashlib.sha1(f"{repo_id}:{folder}".encode()).hexdigest()
        repo = self.repos[repo_id] = Repo(folder, commit, token)
        return repo

    def start(self, port: int = 0) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._handle(self, body=False)

            def do_GET(self) -> None:
                hub._handle(self, body=True)

        self._server = ThreadingHTTPServer((self.host, port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- protocol ---------------------------------------------------------------------

    def _handle(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((h.command, path, h.headers.get("range")))
        if path.startswith("/api/models/"):
            repo_id, _, rev = path.removeprefix("/api/models/").partition("/revision/")
            repo = self._authorised(h, repo_id)
            if repo is None:
                return
            if rev not in (repo.commit, *repo.branches):
                return _error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return _json(h, self._listing(repo_id, repo))
        if path.startswith("/cdn/"):
            repo_id, _, rel = path.removeprefix("/cdn/").partition("/-/")
            return self._send_file(h, self.repos[repo_id].folder / rel, rel, body)
        owner, name, kind, rev, rel = (path.lstrip("/").split("/", 4) + [""] * 5)[:5]
        repo = self._authorised(h, f"{owner}/{name}")
        if repo is None:
            return
        if kind != "resolve" or rev not in (repo.commit, *repo.branches):
            return _error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
        file = repo.folder / rel
        if not file.is_file():
            return _error(h, 404, "EntryNotFound", f"{rel} does not exist")
        if rel.endswith(LFS_SUFFIXES):  # the real hub sends LFS files to a CDN
            h.send_response(302)
            h.send_header("location", f"/cdn/{owner}/{name}/-/{rel}")
            h.send_header("content-length", "0")
            h.end_headers()
            return
        self._send_file(h, file, rel, body)

    def _authorised(self, h: BaseHTTPRequestHandler, repo_id: str) -> Repo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            _error(h, 404, "RepoNotFound", "Repository not found")
            return None
        if repo.token and h.headers.get("authorization") != f"Bearer {repo.token}":
            _error(h, 401, "GatedRepo", f"Access to model {repo_id} is restricted.")
            return None
        return repo

    def _listing(self, repo_id: str, repo: Repo) -> dict[str, object]:
        siblings = []
        for p in sorted(repo.folder.rglob("*")):
            if not p.is_file():
                continue
            rel = p.relative_to(repo.folder).as_posix()
            data = p.read_bytes()
            entry: dict[str, object] = {"rfilename": rel, "size": len(data)}
            if rel.endswith(LFS_SUFFIXES):
                entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
            siblings.append(entry)
        return {"id": repo_id, "sha": repo.commit, "siblings": siblings}

    def _send_file(self, h: BaseHTTPRequestHandler, file: Path, rel: str, body: bool) -> None:
        data = file.read_bytes()
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
        h.send_header("etag", f'"{hashlib.sha256(data).hexdigest()}"')
        h.end_headers()
        if not body:
            return
        cut = self.cut_once.pop(rel, None)
        if cut is not None:  # a broken connection mid-file
            h.wfile.write(data[start:cut])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)
            return
        h.wfile.write(data[start:])


def _json(h: BaseHTTPRequestHandler, obj: object) -> None:
    raw = json.dumps(obj).encode()
    h.send_response(200)
    h.send_header("content-type", "application/json")
    h.send_header("content-length", str(len(raw)))
    h.end_headers()
    h.wfile.write(raw)


def _error(h: BaseHTTPRequestHandler, status: int, code: str, message: str) -> None:
    raw = json.dumps({"error": message}).encode()
    h.send_response(status)
    h.send_header("x-error-code", code)
    h.send_header("content-type", "application/json")
    h.send_header("content-length", str(len(raw)))
    h.end_headers()
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
