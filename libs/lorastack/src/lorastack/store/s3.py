"""`s3://BUCKET[/PREFIX]` backend over boto3 (MinIO under compose, moto in tests).

Retries are ours, not botocore's: transient errors (connection failures, timeouts,
5xx, throttling) are retried a bounded number of times with jittered exponential
backoff; 4xx answers are final. The manifest is written with `If-None-Match: *`, so
the second writer of a version gets HTTP 412 and we raise `Conflict`.

Blobs over `s3_multipart_mb` go up as multipart uploads that survive a failure: the key
is the content's sha256, so an unfinished upload of that key (ListMultipartUploads) holds
parts of the very same bytes, and a retried publish uploads only the parts that are not
there yet (ListParts, followed page by page: S3 answers at most 1,000 parts a page). An
unfinished upload is no object: nothing is visible until CompleteMultipartUpload, and the
manifest comes after every blob. S3 takes at most 10,000 parts: a file that would need more
at `s3_multipart_mb` goes up in larger parts (`part_size_for`, whole MiB).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    ReadTimeoutError,
)
from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential_jitter,
)

from lorastack.errors import ConfigError, Conflict, NotFound, StoreUnavailable
from lorastack.settings import CommonSettings
from lorastack.store.backend import RecordManifests, blob_key, manifest_key

log = logging.getLogger(__name__)
T = TypeVar("T")
MIB = 1024 * 1024
S3_MAX_PARTS = 10_000  # parts of one multipart upload (S3 and MinIO)
S3_MAX_OBJECT_BYTES = 5 * 1024**4  # 5 TiB
S3_PAGE = 1000  # the most entries S3 returns in one list page
_TRANSIENT_CODES = {
    "SlowDown",
    "RequestTimeout",
    "Throttling",
    "InternalError",
    "ServiceUnavailable",
}


def _status(err: ClientError) -> int:
    return int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def is_transient(err: BaseException) -> bool:
    """True for errors worth another try: network trouble, 5xx, throttling."""
    if isinstance(
        err,
        EndpointConnectionError | ConnectionClosedError | ConnectTimeoutError | ReadTimeoutError,
    ):
        return True
    if isinstance(err, ClientError):
        code = err.response.get("Error", {}).get("Code", "")
        return _status(err) >= 500 or code in _TRANSIENT_CODES
    return False


def part_size_for(size: int, wanted: int) -> int:
    """The part size for a file of `size` bytes: `wanted`, or the smallest whole MiB that
    keeps it within S3_MAX_PARTS parts (1 TiB at 16 MiB would need 65,536: 105 MiB).
    Never above S3's 5 GiB part limit, since an object is at most 5 TiB."""
    if size > S3_MAX_OBJECT_BYTES:
        raise ConfigError(
            f"a file of {size / 1024**4:.1f} TiB is over S3's 5 TiB object limit",
            "split the file (e.g. sharded safetensors) before publishing it",
        )
    least = -(-size // S3_MAX_PARTS)  # bytes a part, at the part limit
    return max(wanted, -(-least // MIB) * MIB)


class S3Backend(RecordManifests):
    """The `s3://BUCKET[/PREFIX]` backend over boto3."""

    def __init__(
        self,
        bucket: str,
        prefix: str,
        settings: CommonSettings,
        *,
        list_page_size: int = S3_PAGE,  # entries a list call asks for (tests ask for fewer)
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.endpoint = settings.s3_endpoint_url or "the AWS S3 endpoint"
        self._attempts = settings.s3_max_attempts
        self._client: Any = boto3.client(
            "s3",
            endpoint_url=settings.s3_endpoint_url,
            region_name=settings.s3_region,
            aws_access_key_id=(
                settings.s3_access_key_id.get_secret_value() if settings.s3_access_key_id else None
            ),
            aws_secret_access_key=(
                settings.s3_secret_access_key.get_secret_value()
                if settings.s3_secret_access_key
                else None
            ),
            config=Config(retries={"max_attempts": 1, "mode": "standard"}, connect_timeout=10),
        )
        part = settings.s3_multipart_mb * MIB
        self._part_bytes = part
        self._page = list_page_size
        self._transfer = TransferConfig(multipart_threshold=part, multipart_chunksize=part)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, fn: Callable[[], T], what: str) -> T:
        try:
            for attempt in Retrying(
                stop=stop_after_attempt(self._attempts),
                wait=wait_exponential_jitter(initial=0.2, max=5),
                retry=retry_if_exception(is_transient),
                reraise=False,
            ):
                with attempt:
                    return fn()
        except RetryError as e:
            last = e.last_attempt.exception()
            raise StoreUnavailable(
                f"{what} on {self.url} (endpoint {self.endpoint}) failed {self._attempts}"
                f" times: {last}",
                "check that the S3 endpoint is up and reachable (LORASTACK_S3_ENDPOINT_URL);"
                " publishing again resumes where this one stopped",
            ) from last
        raise AssertionError("unreachable")

    def has_blob(self, sha256: str) -> bool:
        """HEAD the blob's object: False on 404."""
        try:
            self._call(
                lambda: self._client.head_object(
                    Bucket=self.bucket, Key=self._key(blob_key(sha256))
                ),
                "head blob",
            )
        except ClientError as e:
            if _status(e) == 404:
                return False
            raise
        return True

    def put_blob(self, sha256: str, src: Path) -> None:
        """Upload `src` (multipart when large) unless the blob is already there."""
        if self.has_blob(sha256):
            return
        key = self._key(blob_key(sha256))
        if src.stat().st_size <= self._part_bytes:
            self._call(
                lambda: self._client.upload_file(str(src), self.bucket, key, Config=self._transfer),
                f"upload of {src.name}",
            )
            return
        self._put_multipart(key, src)

    def _put_multipart(self, key: str, src: Path) -> None:
        """Upload `src` in parts, continuing an unfinished upload of `key` if there is one."""
        size = src.stat().st_size
        part = part_size_for(size, self._part_bytes)
        count = -(-size // part)
        expected = {n: min(part, size - (n - 1) * part) for n in range(1, count + 1)}
        upload_id, done = self._unfinished_upload(key, expected)
        if upload_id is None:
            upload_id = self._call(
                lambda: self._client.create_multipart_upload(Bucket=self.bucket, Key=key),
                f"start of the upload of {src.name}",
            )["UploadId"]
        elif done:
            log.info("resuming the upload of %s: %d of %d parts stored", src.name, len(done), count)
        with src.open("rb") as f:
            for n in range(1, count + 1):
                if n in done:
                    continue
                f.seek((n - 1) * part)
                data = f.read(expected[n])
                resp = self._call(
                    lambda n=n, data=data: self._client.upload_part(  # type: ignore[misc]
                        Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=n, Body=data
                    ),
                    f"upload of part {n}/{count} of {src.name}",
                )
                done[n] = resp["ETag"]
        parts = [{"PartNumber": n, "ETag": done[n]} for n in sorted(done)]
        self._call(
            lambda: self._client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            ),
            f"completion of the upload of {src.name}",
        )

    def _unfinished_upload(
        self, key: str, expected: dict[int, int]
    ) -> tuple[str | None, dict[int, str]]:
        """(upload id, {part number: ETag}) of an unfinished upload of `key` whose parts
        have the sizes this one would give them; (None, {}) when there is none."""
        uploads = self._pages(
            "list_multipart_uploads", "Uploads", "list of unfinished uploads", Prefix=key
        )
        for up in uploads:
            if up["Key"] != key:
                continue
            listed = self._pages(
                "list_parts", "Parts", "list of uploaded parts", Key=key, UploadId=up["UploadId"]
            )
            if all(expected.get(p["PartNumber"]) == p["Size"] for p in listed):
                return up["UploadId"], {p["PartNumber"]: p["ETag"] for p in listed}
        return None, {}

    def _pages(self, operation: str, field: str, what: str, **params: Any) -> list[Any]:
        """Every entry of a paginated list call, page after page (boto3's paginator
        follows the markers: NextPartNumberMarker, NextKeyMarker/NextUploadIdMarker)."""
        paginator = self._client.get_paginator(operation)
        pages = self._call(
            lambda: list(
                paginator.paginate(
                    Bucket=self.bucket, **params, PaginationConfig={"PageSize": self._page}
                )
            ),
            what,
        )
        return [entry for page in pages for entry in page.get(field, [])]

    def download_blob(self, sha256: str, dest: Path) -> None:
        """Download the blob's object to `dest`; NotFound on 404."""
        key = self._key(blob_key(sha256))
        try:
            self._call(
                lambda: self._client.download_file(
                    self.bucket, key, str(dest), Config=self._transfer
                ),
                f"download of blob {sha256[:12]}",
            )
        except ClientError as e:
            if _status(e) == 404:
                raise NotFound(f"blob {sha256} is missing from {self.url}") from None
            raise

    def put_record(self, key: str, data: bytes) -> None:
        """PUT the record with If-None-Match: *; Conflict when it exists (409, 412)."""
        try:
            self._call(
                lambda: self._client.put_object(
                    Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*"
                ),
                f"write of {key}",
            )
        except ClientError as e:
            if _status(e) in (409, 412):
                raise Conflict(
                    f"{key} already exists in {self.url}", "write the next one"
                ) from None
            raise

    def get_record(self, key: str) -> bytes:
        """GET the record's object; NotFound on 404."""
        try:
            resp = self._call(
                lambda: self._client.get_object(Bucket=self.bucket, Key=self._key(key)),
                f"read of {key}",
            )
        except ClientError as e:
            if _status(e) == 404:
                raise NotFound(f"{key} is not in {self.url}") from None
            raise
        body: bytes = resp["Body"].read()
        return body

    def list_records(self, prefix: str) -> list[str]:
        """List the objects under `prefix` (every page), keys sorted."""
        root = self._key("")
        paginator = self._client.get_paginator("list_objects_v2")
        pages = self._call(
            lambda: list(paginator.paginate(Bucket=self.bucket, Prefix=root + prefix)), "list"
        )
        return sorted(obj["Key"][len(root) :] for page in pages for obj in page.get("Contents", []))

    def delete_manifest(self, name: str, version: str) -> None:
        """Delete the manifest's object (S3 ignores an absent one)."""
        key = self._key(manifest_key(name, version))
        self._call(lambda: self._client.delete_object(Bucket=self.bucket, Key=key), "delete")

    def list_manifests(self, prefix: str) -> list[tuple[str, str]]:
        """List objects under manifests/`prefix` (every page) for their @VERSION.json keys."""
        root = self._key("manifests/")
        out = []
        paginator = self._client.get_paginator("list_objects_v2")
        pages = self._call(
            lambda: list(paginator.paginate(Bucket=self.bucket, Prefix=root + prefix)), "list"
        )
        for page in pages:
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(root) :]
                name, _, leaf = rel.rpartition("/@")
                if leaf.endswith(".json") and name:
                    out.append((name, leaf[:-5]))
        return out
