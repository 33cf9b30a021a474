"""The tests' S3 server (moto's, on loopback, its writes one at a time) and a bucket of its
own on it, as CommonSettings."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from lorastack.settings import CommonSettings

WRITES = frozenset({"PUT", "POST", "DELETE"})


class _WritesInTurn:
    """WSGI middleware: one write request at a time, reads beside them. S3 makes a
    conditional PUT (If-None-Match: *) atomic; moto checks the key and stores the object in
    two steps, so two writers racing on one key could both get 200 (seen under load: two
    declarations numbered 5, one lost)."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get("REQUEST_METHOD") not in WRITES:
            return self.app(environ, start_response)
        with self.lock:
            return list(self.app(environ, start_response))  # the whole answer, under the lock


class S3Server:
    """moto's S3 on 127.0.0.1:`port` in a thread of this process, its writes in turn."""

    def __init__(self, port: int) -> None:
        from moto.moto_server.werkzeug_app import MotoRequestHandler
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        app = _WritesInTurn(DomainDispatcherApplication(create_backend_app))
        self.server = make_server(
            "127.0.0.1", port, app, threaded=True, request_handler=MotoRequestHandler
        )
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.endpoint = f"http://127.0.0.1:{port}"

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.thread.join()


def s3_settings(home: Path, endpoint: str, **extra: Any) -> CommonSettings:
    """CommonSettings for a new bucket (created here) on the S3 server at `endpoint`."""
    import boto3

    bucket = f"b-{uuid.uuid4().hex[:12]}"
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
    ).create_bucket(Bucket=bucket)
    return CommonSettings(
        home=home,
        store_url=f"s3://{bucket}/team",
        s3_endpoint_url=endpoint,
        s3_access_key_id="test",
        s3_secret_access_key="test",
        s3_max_attempts=2,
        **extra,
    )
