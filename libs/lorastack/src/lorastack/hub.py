"""The Hugging Face Hub's download protocol, for `lorastack model import REPO_ID`.

Owns the two HTTP calls a download needs and nothing else:

    GET {endpoint}/api/models/{repo}/revision/{revision}?blobs=true
        -> {"sha": COMMIT, "siblings": [{"rfilename", "size", "lfs": {"sha256", "size"}}]}
    GET {endpoint}/{repo}/resolve/{COMMIT}/{path}     (redirects followed; Range to resume)

A file is written to `<name>.part` and renamed when complete; a `.part` left by an
interrupted run is continued with `Range: bytes=N-`. LFS files (the weights) are
verified against the sha256 the listing gives. Which files to take, and what to do with
them, is `base_model`'s business. The token is sent to the endpoint's host only (httpx
drops Authorization on a redirect to another host, e.g. a CDN).

Errors: 401/403 -> ConfigError (token or gated repo), 404 -> NotFound (repo, revision or
file), other HTTP errors and broken connections -> StoreUnavailable, a wrong sha256 ->
IntegrityError.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx
from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from lorastack.errors import ConfigError, IntegrityError, NotFound, StoreUnavailable
from lorastack.manifest import sha256_file

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]  # (file, bytes so far, total bytes)


class HubSettings(BaseSettings):
    """The Hub client's own settings, under the names every Hugging Face tool reads."""

    model_config = SettingsConfigDict(env_prefix="HF_", extra="ignore")

    token: SecretStr | None = None  # HF_TOKEN: for gated or private repos
    endpoint: str = ""  # HF_ENDPOINT: a mirror or a test server; "" = the public Hub
    timeout_s: float = 60.0  # seconds without a byte before a read gives up

    @property
    def resolved_endpoint(self) -> str:
        if self.endpoint:
            return self.endpoint.rstrip("/")
        from huggingface_hub import constants  # the public Hub's address lives there

        return constants._HF_DEFAULT_ENDPOINT


@dataclass(frozen=True)
class RemoteFile:
    path: str  # relative to the repo root
    size: int | None  # bytes, when the listing gives it
    sha256: str | None  # LFS files only


@dataclass(frozen=True)
class RepoListing:
    repo_id: str
    commit: str  # the 40-hex commit the revision resolved to
    files: list[RemoteFile]


class HubClient:
    def __init__(self, settings: HubSettings, transport: httpx.BaseTransport | None = None):
        self.endpoint = settings.resolved_endpoint
        headers = {"user-agent": "lorastack"}
        if settings.token is not None:
            headers["authorization"] = f"Bearer {settings.token.get_secret_value()}"
        self._http = httpx.Client(
            headers=headers,
            follow_redirects=True,
            timeout=httpx.Timeout(settings.timeout_s, connect=15.0),
            transport=transport,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> HubClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def listing(self, repo_id: str, revision: str) -> RepoListing:
        url = f"{self.endpoint}/api/models/{repo_id}/revision/{quote(revision, safe='')}"
        try:
            r = self._http.get(url, params={"blobs": "true"})
        except httpx.HTTPError as e:
            raise StoreUnavailable(
                f"cannot reach the model hub at {self.endpoint}: {e}",
                "check the network (or HF_ENDPOINT), then run the same command again",
            ) from None
        _raise_for(r, f"{repo_id}@{revision}")
        data = r.json()
        files = [
            RemoteFile(
                path=s["rfilename"],
                size=(s.get("lfs") or {}).get("size", s.get("size")),
                sha256=(s.get("lfs") or {}).get("sha256"),
            )
            for s in data.get("siblings", [])
        ]
        return RepoListing(repo_id=repo_id, commit=data["sha"], files=files)

    def download(
        self, listing: RepoListing, file: RemoteFile, dest: Path, progress: Progress | None = None
    ) -> Path:
        """Download `file` at the listing's commit to `dest`, continuing a `.part` left over."""
        if dest.is_file() and _complete(dest, file):
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(dest.name + ".part")
        have = part.stat().st_size if part.exists() else 0
        url = f"{self.endpoint}/{listing.repo_id}/resolve/{listing.commit}/{quote(file.path)}"
        headers = {"range": f"bytes={have}-"} if have else {}
        try:
            with self._http.stream("GET", url, headers=headers) as r:
                if r.status_code == 416 and have:  # the part is already whole
                    pass
                else:
                    _raise_for(r, f"{listing.repo_id}/{file.path}")
                    if have and r.status_code != 206:
                        have = 0  # the server ignored the range: start over
                    total = have + int(r.headers.get("content-length", 0)) or (file.size or 0)
                    with part.open("ab" if have else "wb") as out:
                        done = have
                        for chunk in r.iter_bytes():  # as they arrive: a break keeps them
                            out.write(chunk)
                            done += len(chunk)
                            if progress:
                                progress(file.path, done, total)
        except httpx.HTTPError as e:
            raise StoreUnavailable(
                f"the download of {file.path} broke off at {_size(part)} bytes: {e}",
                "run the same command again: it continues where it stopped",
            ) from None
        if file.size is not None and part.stat().st_size != file.size:
            raise StoreUnavailable(
                f"{file.path}: got {part.stat().st_size} of {file.size} bytes",
                "run the same command again: it continues where it stopped",
            )
        if file.sha256 is not None and sha256_file(part) != file.sha256:
            part.unlink()
            raise IntegrityError(
                f"{file.path} does not match the sha256 the hub lists ({file.sha256[:12]}...)",
                "run the same command again (the bad download was deleted)",
            )
        part.replace(dest)
        return dest


def _raise_for(r: httpx.Response, what: str) -> None:
    if r.status_code < 400:
        return
    if r.status_code in (401, 403):
        raise ConfigError(
            f"the model hub refused access to {what} ({r.status_code})",
            "a gated or private repo needs HF_TOKEN set to a token whose account accepted "
            "the model's licence on the hub",
        )
    if r.status_code == 404:
        code = r.headers.get("x-error-code", "")
        if code == "RevisionNotFound":
            raise NotFound(f"revision not found: {what}", "give a branch, tag or commit sha")
        raise NotFound(
            f"not found on the model hub: {what}",
            "check the repo id (OWNER/NAME) and, for a private repo, HF_TOKEN",
        )
    raise StoreUnavailable(f"the model hub answered {r.status_code} for {what}", "try again later")


def _complete(path: Path, file: RemoteFile) -> bool:
    if file.size is not None and path.stat().st_size != file.size:
        return False
    return file.sha256 is None or sha256_file(path) == file.sha256


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0
