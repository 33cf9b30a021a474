"""Downloads from a Hugging Face model hub, through `huggingface_hub`, for `lorastack model import`.

Owns the calls into the library and the translation of its errors; which files to take and
what to do with them is `base_model`'s business. The library does the protocol: it resolves
a revision to a commit (`GET /api/models/{repo}/revision/{rev}`), lists the commit's tree
(`GET /api/models/{repo}/tree/{commit}`, paginated), reads each file's ETag, size and
commit with `HEAD /{repo}/resolve/{commit}/{path}` (`X-Repo-Commit`, `X-Linked-Etag`,
`X-Linked-Size` on an LFS redirect), then downloads: a dropped connection is resumed with a
`Range` request, each download goes to a file of its own (`*.{random}.incomplete`, never a
partial file left by another run or process), each blob is taken under a file lock, and a
wrong length is an error. Files land in the library's cache layout under
HOME/models/hub (`models--OWNER--NAME/snapshots/COMMIT/...`, links into `blobs/`), so a
second import of one commit downloads nothing.

Settings are the names every Hugging Face tool reads: HF_ENDPOINT (a mirror or a test
server), HF_TOKEN (gated or private repos; else the library's stored login). HF_HUB_OFFLINE
is the library's own switch: set, an import is refused with that name. Timeouts and retries
are the library's too (HF_HUB_ETAG_TIMEOUT, HF_HUB_DOWNLOAD_TIMEOUT: seconds).

Errors (`hub_errors`, the one map): gated or private without access -> ConfigError, repo,
revision or file not found -> NotFound, offline mode -> ConfigError, anything else from
the network or the hub -> StoreUnavailable.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from lorastack.errors import ConfigError, NotFound, StoreUnavailable

log = logging.getLogger(__name__)


class HubSettings(BaseSettings):
    """The Hub client's own settings, under the names every Hugging Face tool reads."""

    model_config = SettingsConfigDict(env_prefix="HF_", extra="ignore")

    token: SecretStr | None = None  # HF_TOKEN: for gated or private repos
    endpoint: str = ""  # HF_ENDPOINT: a mirror or a test server; "" = the public Hub

    @property
    def resolved_endpoint(self) -> str:
        if self.endpoint:
            return self.endpoint.rstrip("/")
        from huggingface_hub import constants  # the public Hub's address lives there

        return constants._HF_DEFAULT_ENDPOINT

    @property
    def token_value(self) -> str | None:
        """None (unset or empty, as compose passes `${HF_TOKEN:-}`): the library's stored
        login (`hf auth login`), if any."""
        return (self.token.get_secret_value() or None) if self.token is not None else None


@dataclass(frozen=True)
class RemoteFile:
    """One file of a hub repository listing."""

    path: str  # relative to the repo root
    size: int | None  # bytes, when the listing gives it
    sha256: str | None  # LFS files only


@dataclass(frozen=True)
class RepoListing:
    """A hub repository's files at the commit its revision resolved to."""

    repo_id: str
    commit: str  # the 40-hex commit the revision resolved to
    files: list[RemoteFile]


@contextlib.contextmanager
def hub_errors(what: str, endpoint: str) -> Iterator[None]:
    """The library's exceptions as lorastack errors that say what to change."""
    import httpx2  # huggingface_hub's HTTP client
    from huggingface_hub import errors as hf

    try:
        yield
    except (hf.GatedRepoError, hf.DisabledRepoError) as e:
        raise ConfigError(
            f"the model hub refused access to {what} ({_status(e)}: gated or private)",
            "a gated or private repo needs HF_TOKEN set to a token whose account accepted "
            "the model's licence on the hub",
        ) from None
    except hf.RevisionNotFoundError:
        raise NotFound(f"revision not found: {what}", "give a branch, tag or commit sha") from None
    except (hf.RemoteEntryNotFoundError, hf.EntryNotFoundError):
        raise NotFound(f"file not found on the model hub: {what}", "check the path") from None
    except hf.RepositoryNotFoundError:  # the hub answers so for a private repo too
        raise NotFound(
            f"not found on the model hub: {what}",
            "check the repo id (OWNER/NAME) and, for a private repo, HF_TOKEN",
        ) from None
    except hf.OfflineModeIsEnabled:
        raise ConfigError(
            f"cannot download {what}: HF_HUB_OFFLINE is set",
            "unset HF_HUB_OFFLINE (and TRANSFORMERS_OFFLINE) for the import",
        ) from None
    except hf.HfHubHTTPError as e:
        raise StoreUnavailable(
            f"the model hub at {endpoint} answered {_status(e)} for {what}",
            "try again later; a download continues from the files already complete",
        ) from None
    except (hf.LocalEntryNotFoundError, hf.FileMetadataError) as e:
        raise StoreUnavailable(
            f"cannot reach the model hub at {endpoint} for {what}: {str(e).splitlines()[0]}",
            "check the network (or HF_ENDPOINT), then run the same command again",
        ) from None
    except OSError as e:  # httpx2's errors are not OSError; a short file or a full disk is
        raise StoreUnavailable(
            f"the download of {what} failed: {str(e).splitlines()[0] if str(e) else e!r}",
            "run the same command again: complete files are kept",
        ) from None
    except httpx2.HTTPError as e:  # the library's transport: connect, timeout, protocol
        raise StoreUnavailable(
            f"cannot reach the model hub at {endpoint} for {what}: {e}",
            "check the network (or HF_ENDPOINT), then run the same command again",
        ) from None


def _status(e: Exception) -> int | str:
    response = getattr(e, "response", None)
    return getattr(response, "status_code", "?")


def listing(hub: HubSettings, repo_id: str, revision: str) -> RepoListing:
    """The commit `revision` resolves to, and its files with sizes and LFS sha256."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub.resolved_endpoint, token=hub.token_value, library_name="lorastack")
    with hub_errors(f"{repo_id}@{revision}", hub.resolved_endpoint):
        info = api.model_info(repo_id, revision=revision, files_metadata=True)
    if not info.sha:
        raise StoreUnavailable(
            f"the model hub at {hub.resolved_endpoint} gave no commit for {repo_id}@{revision}",
            "is HF_ENDPOINT a Hugging Face hub?",
        )
    files = [
        RemoteFile(
            path=s.rfilename,
            size=s.lfs.size if s.lfs is not None else s.size,
            sha256=s.lfs.sha256 if s.lfs is not None else None,
        )
        for s in info.siblings or []
    ]
    return RepoListing(repo_id=repo_id, commit=info.sha, files=files)


def download_file(hub: HubSettings, listing: RepoListing, path: str, cache_dir: Path) -> Path:
    """One file of the listing's commit (e.g. config.json, to check before the weights)."""
    from huggingface_hub import hf_hub_download

    with hub_errors(f"{listing.repo_id}/{path}", hub.resolved_endpoint):
        return Path(
            hf_hub_download(
                listing.repo_id,
                path,
                revision=listing.commit,
                cache_dir=cache_dir,
                endpoint=hub.resolved_endpoint,
                token=hub.token_value,
                library_name="lorastack",
            )
        )


def download_snapshot(
    hub: HubSettings,
    listing: RepoListing,
    allow_patterns: Sequence[str],
    ignore_patterns: Sequence[str],
    cache_dir: Path,
) -> Path:
    """The files of the listing's commit that the patterns allow, as the snapshot folder
    (links into the cache's blobs); what is already complete is not downloaded again."""
    from huggingface_hub import snapshot_download

    with hub_errors(f"{listing.repo_id}@{listing.commit[:12]}", hub.resolved_endpoint):
        folder = snapshot_download(
            listing.repo_id,
            revision=listing.commit,  # pinned: every file from the commit the listing named
            cache_dir=cache_dir,
            allow_patterns=list(allow_patterns),
            ignore_patterns=list(ignore_patterns),
            endpoint=hub.resolved_endpoint,
            token=hub.token_value,
            library_name="lorastack",
        )
    return Path(str(folder))
