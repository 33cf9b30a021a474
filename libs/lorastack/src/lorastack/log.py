"""Logging set-up shared by the CLI and the services: one line per record, to stderr."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str = "INFO") -> None:
    """One line per record to stderr at `level`; chatty libraries only from WARNING."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("botocore", "boto3", "s3transfer", "urllib3", "httpx", "httpx2", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
