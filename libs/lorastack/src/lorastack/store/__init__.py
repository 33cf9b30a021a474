"""The artifact store: one interface (`ArtifactStore`), two backends (`file://`, `s3://`).

Layout inside a store, the same for both backends:

    blobs/sha256/<hh>/<sha256>            file contents, addressed by their sha256
    manifests/<name>/@<version>.json      one manifest per published version
    labels/<name>/@<label>/<seq>.json     moves of a label (NAME@LABEL), see labels.py
    deployments/<name>/adapters/<seq>.json  the adapters a deployment serves, see declared.py

Files are uploaded first as content-addressed blobs (idempotent, so concurrent writers
never overwrite each other's bytes); the manifest is written last with an exclusive
create, so a reader never sees a half-published version and the second writer of one
version gets `Conflict`. Downloads are verified against the sha256 and cached by digest.
"""

from lorastack.store.artifacts import ArtifactStore, open_store
from lorastack.store.backend import Backend
from lorastack.store.labels import LabelRecord

__all__ = ["ArtifactStore", "Backend", "LabelRecord", "open_store"]
