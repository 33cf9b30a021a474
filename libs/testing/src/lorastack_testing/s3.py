"""A bucket of its own on a test S3 server (moto's, on loopback), as CommonSettings."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from lorastack.settings import CommonSettings


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
