"""Declared adapters: the set of LoRA adapters a deployment serves, kept in the store.

Owns the declaration record, its keys and how it changes; not loading adapters (each
inference replica reconciles to the declaration, `inference.declared_adapters`) nor who
may change it (the supervisor's /admin routes ask for the admin key).

    deployments/<deployment>/adapters/<seq>.json     one immutable record per change

A record holds the whole set, so the one with the highest seq is in force and the
earlier ones are the history. `seq` is the declaration's version (an etag): a change
reads the record in force (seq N) and writes seq N+1 with the backend's exclusive create,
on `file://` and `s3://` alike, so two replicas changing one deployment at once never lose
a change: the second one's create fails, and it re-reads and applies its change again.
Reading is one list and one small read, cheap enough to repeat every few seconds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from pydantic import BaseModel, Field, ValidationError

from lorastack.errors import Conflict, InvalidManifest, InvalidName
from lorastack.manifest import now_iso, split_ref, validate_name
from lorastack.store.backend import Backend
from lorastack.store.labels import who

DEPLOYMENTS = "deployments/"  # key prefix of every declaration record
_CHANGE_TRIES = 8
SCHEMA_VERSION = 1


class DeclaredAdapter(BaseModel):
    """One adapter a deployment serves: its ref, served name and digest."""

    ref: str  # NAME:VERSION (pinned when declared) or NAME@LABEL (follows the label)
    served_name: str  # the id vLLM serves it under (NAME-vVERSION or NAME-LABEL)
    digest: str = ""  # content digest when declared (a label may move on since)


class Declaration(BaseModel):
    """The adapters a deployment serves, as of one numbered change."""

    schema_version: int = SCHEMA_VERSION
    deployment: str
    seq: int = Field(0, ge=0)  # 0: nothing was ever declared
    adapters: list[DeclaredAdapter] = []
    created: str = ""
    by: str = ""  # user@host of the change
    change: str = ""  # what this record changed, e.g. "declare demo/adapter:3"

    def served_names(self) -> list[str]:
        """The served name of each declared adapter."""
        return [a.served_name for a in self.adapters]


def declaration_key(deployment: str, seq: int) -> str:
    """One record of a deployment's declaration; `seq` zero-padded so keys sort by it."""
    return f"{DEPLOYMENTS}{deployment}/adapters/{seq:08d}.json"


def _latest_seq(backend: Backend, deployment: str) -> int:
    prefix = f"{DEPLOYMENTS}{deployment}/adapters/"
    seqs = [
        int(leaf[:-5])
        for leaf in (key[len(prefix) :] for key in backend.list_records(prefix))
        if "/" not in leaf and leaf.endswith(".json") and leaf[:-5].isdigit()
    ]
    return max(seqs, default=0)


_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def _read(backend: Backend, deployment: str, seq: int) -> Declaration:
    """The checked record `seq`: its deployment and seq are the key's, every ref, served
    name and digest follows the rules (InvalidManifest names the field)."""
    if seq == 0:
        return Declaration(deployment=deployment)
    key = declaration_key(deployment, seq)
    hint = "remove that record from the store (the one before it is then in force)"
    try:
        validate_name(deployment, "deployment name")
        d = Declaration.model_validate(json.loads(backend.get_record(key)))
    except (ValueError, ValidationError, InvalidName) as e:  # not JSON, not a declaration
        raise InvalidManifest(
            f"{key} in {backend.url} is not a declaration of adapters: {str(e)[:300]}", hint
        ) from None
    problems = [
        f"{field} {got!r} is not the key's {want!r}"
        for field, got, want in (("deployment", d.deployment, deployment), ("seq", d.seq, seq))
        if got != want
    ]
    for i, a in enumerate(d.adapters):
        try:
            split_ref(a.ref)
            validate_name(a.served_name, "served adapter name")
        except InvalidName as e:
            problems.append(f"adapters[{i}]: {e.message}")
        if a.digest and not _DIGEST.fullmatch(a.digest):
            problems.append(f"adapters[{i}].digest {a.digest[:80]!r} is not a sha256 digest")
    if problems:
        raise InvalidManifest(f"{key} in {backend.url}: {'; '.join(problems)[:400]}", hint)
    return d


def current(backend: Backend, deployment: str) -> Declaration:
    """The declaration in force (seq 0 and no adapters when none was ever written)."""
    validate_name(deployment, "deployment name")
    return _read(backend, deployment, _latest_seq(backend, deployment))


Edit = Callable[[list[DeclaredAdapter]], list[DeclaredAdapter]]


def change(backend: Backend, deployment: str, edit: Edit, what: str) -> Declaration:
    """Apply `edit` to the adapters in force and write the result as the next record;
    an edit that changes nothing writes nothing. Retries when another writer wins."""
    validate_name(deployment, "deployment name")
    for _ in range(_CHANGE_TRIES):
        now = current(backend, deployment)
        adapters = edit(list(now.adapters))
        if adapters == now.adapters:
            return now
        record = Declaration(
            deployment=deployment,
            seq=now.seq + 1,
            adapters=adapters,
            created=now_iso(),
            by=who(),
            change=what,
        )
        try:
            backend.put_record(
                declaration_key(deployment, record.seq),
                (record.model_dump_json(indent=2) + "\n").encode(),
            )
            return record
        except Conflict:
            continue  # another replica changed it meanwhile: apply ours to theirs
    raise Conflict(
        f"could not change the adapters of deployment {deployment} after {_CHANGE_TRIES} tries",
        "another writer is changing the same deployment; retry",
    )


def declare(backend: Backend, deployment: str, adapter: DeclaredAdapter) -> Declaration:
    """Add `adapter` (replacing an entry of the same served name)."""

    def add(adapters: list[DeclaredAdapter]) -> list[DeclaredAdapter]:
        if adapter in adapters:
            return adapters  # already declared as is
        return [*(a for a in adapters if a.served_name != adapter.served_name), adapter]

    return change(backend, deployment, add, f"declare {adapter.ref}")


def withdraw(backend: Backend, deployment: str, served_name: str) -> Declaration:
    """Remove the entry served as `served_name` (nothing written when there is none)."""

    def remove(adapters: list[DeclaredAdapter]) -> list[DeclaredAdapter]:
        return [a for a in adapters if a.served_name != served_name]

    return change(backend, deployment, remove, f"withdraw {served_name}")


def all_current(backend: Backend) -> list[Declaration]:
    """The declaration in force of every deployment in the store."""
    latest: dict[str, int] = {}
    for key in backend.list_records(DEPLOYMENTS):
        deployment, sep, leaf = key[len(DEPLOYMENTS) :].rpartition("/adapters/")
        if sep and leaf.endswith(".json") and leaf[:-5].isdigit():
            latest[deployment] = max(latest.get(deployment, 0), int(leaf[:-5]))
    return [_read(backend, d, seq) for d, seq in sorted(latest.items())]
