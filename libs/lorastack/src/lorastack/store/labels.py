"""Labels: a movable name for one published version, `NAME@LABEL` (`runs/demo/adapter@promoted`).

Owns the label record, its keys and its history; not who may move a label (that is the
caller's rule, e.g. `lorastack promote` asks for an improvement verdict first).

    labels/<name>/@<label>/<seq>.json     one immutable record per move; seq 1, 2, 3 ...

The record with the highest seq is in force; the earlier ones are the history (what it
pointed at, who moved it, when, why, on what evidence). A move is written with the
backend's exclusive create, on `file://` and `s3://` alike, so two people moving one
label at once never overwrite each other: the second takes the next seq. Reading a label
is one list and one small read, cheap enough to repeat every few seconds.

A record read back is checked like a manifest (`_load`): its name, label and seq are the
key's, its version follows the naming rules and its digest is a sha256 digest; anything
else is refused with InvalidManifest naming the field.
"""

from __future__ import annotations

import getpass
import json
import re
import socket
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from lorastack.errors import Conflict, InvalidManifest, InvalidName, NotFound, field_errors
from lorastack.manifest import Manifest, now_iso, validate_label, validate_name, validate_version
from lorastack.store.backend import LABELS, Backend, label_key

_MOVE_TRIES = 5
SCHEMA_VERSION = 1


class LabelRecord(BaseModel):
    """One move of a label: the version NAME@LABEL points at from then on."""

    schema_version: int = SCHEMA_VERSION
    name: str  # the artifact name the label belongs to
    label: str
    seq: int = Field(ge=1)  # this move's number in the label's history
    version: str  # what `NAME@LABEL` resolves to
    digest: str  # content digest of that version when the label was moved
    kind: str
    created: str
    by: str  # user@host that moved it
    forced: bool = False  # moved without the evidence the caller asks for
    reason: str = ""  # why (required by `lorastack promote --force`)
    evidence: dict[str, Any] = {}  # e.g. the evaluation report and its numbers

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.label}"

    @property
    def target(self) -> str:
        return f"{self.name}:{self.version}"

    def line(self) -> str:
        """One line for listings: where it points, when, who, on what grounds."""
        ev = self.evidence
        why = f"{ev['metric']} {ev['verdict']} in {ev['report']}" if ev.get("report") else ""
        if self.forced:
            why = f"FORCED: {self.reason}" + (f" [{why}]" if why else "")
        return f"{self.ref:40} -> {self.target:40} {self.created:25} {self.by}  {why or '-'}"


def who() -> str:
    """`user@host` for a record, as far as this process can tell."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry in some containers
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _seqs(backend: Backend, name: str, label: str) -> list[int]:
    prefix = f"{LABELS}{name}/@{label}/"
    out = []
    for key in backend.list_records(prefix):
        leaf = key[len(prefix) :]
        if "/" not in leaf and leaf.endswith(".json") and leaf[:-5].isdigit():
            out.append(int(leaf[:-5]))
    return sorted(out)


_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_REWRITE = "remove that record from the store; move the label again with lorastack promote"


def _load(backend: Backend, name: str, label: str, seq: int) -> LabelRecord:
    """The checked record `seq` of `NAME@LABEL` (InvalidManifest names a bad field)."""
    key = label_key(name, label, seq)
    where = f"label record {key} in {backend.url}"
    try:
        validate_name(name)
        validate_label(label)
        r = LabelRecord.model_validate(json.loads(backend.get_record(key)))
    except (ValueError, InvalidName) as e:  # not JSON, not a record, or a hostile key
        msg = e.message if isinstance(e, InvalidName) else str(e)
        if isinstance(e, ValidationError):
            msg = "; ".join(f"{loc}: {m}" for loc, m in field_errors(e, "record"))
        raise InvalidManifest(f"{where}: {msg[:300]}", _REWRITE) from None
    for field, got, want in (
        ("name", r.name, name),
        ("label", r.label, label),
        ("seq", r.seq, seq),
    ):
        if got != want:
            raise InvalidManifest(f"{where}: {field} {got!r} is not the key's {want!r}", _REWRITE)
    try:
        validate_version(r.version)
    except InvalidName:
        raise InvalidManifest(
            f"{where}: version {r.version!r:.80} breaks the naming rules", _REWRITE
        ) from None
    if not _DIGEST.fullmatch(r.digest):
        raise InvalidManifest(f"{where}: digest {r.digest!r:.80} is not a sha256 digest", _REWRITE)
    return r


def history(backend: Backend, name: str, label: str) -> list[LabelRecord]:
    """Every move of `NAME@LABEL`, oldest first."""
    validate_name(name)
    validate_label(label)
    return [_load(backend, name, label, seq) for seq in _seqs(backend, name, label)]


def current(backend: Backend, name: str, label: str) -> LabelRecord:
    """The record in force for `NAME@LABEL`; NotFound says how to set one."""
    validate_name(name)
    validate_label(label)
    seqs = _seqs(backend, name, label)
    if not seqs:
        raise NotFound(
            f"no label {name}@{label} in {backend.url}",
            f"set it: lorastack promote {name}:VERSION"
            + ("" if label == "promoted" else f" --label {label}")
            + "; list labels: lorastack promote --list",
        )
    return _load(backend, name, label, seqs[-1])


def move(
    backend: Backend,
    label: str,
    target: Manifest,
    *,
    forced: bool = False,
    reason: str = "",
    evidence: dict[str, Any] | None = None,
    by: str | None = None,
) -> LabelRecord:
    """Point `TARGET_NAME@label` at `target` with a new record (exclusive create)."""
    validate_label(label)
    for _ in range(_MOVE_TRIES):
        seqs = _seqs(backend, target.name, label)
        record = LabelRecord(
            name=target.name,
            label=label,
            seq=(seqs[-1] + 1) if seqs else 1,
            version=target.version,
            digest=target.digest,
            kind=target.kind,
            created=now_iso(),
            by=by or who(),
            forced=forced,
            reason=reason,
            evidence=evidence or {},
        )
        try:
            backend.put_record(
                label_key(target.name, label, record.seq),
                (record.model_dump_json(indent=2) + "\n").encode(),
            )
            return record
        except Conflict:
            continue  # someone moved it meanwhile: take the next seq
    raise Conflict(
        f"could not move {target.name}@{label} after {_MOVE_TRIES} tries",
        "another writer is moving the same label; retry",
    )


def all_current(backend: Backend, prefix: str = "") -> list[LabelRecord]:
    """The record in force of every label whose artifact name starts with `prefix`."""
    latest: dict[tuple[str, str], int] = {}
    for key in backend.list_records(LABELS + prefix):
        name, sep, rest = key[len(LABELS) :].rpartition("/@")
        label, slash, leaf = rest.partition("/")
        if not (sep and slash and leaf.endswith(".json") and leaf[:-5].isdigit()):
            continue
        seq = int(leaf[:-5])
        if seq > latest.get((name, label), 0):
            latest[(name, label)] = seq
    return [_load(backend, n, lab, seq) for (n, lab), seq in sorted(latest.items())]
