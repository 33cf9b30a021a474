"""The one HTTP transport to an OpenAI-compatible endpoint (vLLM, the gateway, anything).

Owns URLs, the API key header, timeouts and retries: 408/409/429/5xx and connection
errors are retried (at most `attempts` tries, exponential backoff with jitter, a
`Retry-After` honoured up to `_MAX_RETRY_AFTER_S`); any other status is final. Knows
nothing of evaluation or load: callers build payloads and read answers.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx

from lorastack.error_body import error_message
from lorastack.errors import ConfigError, LorastackError

RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})
_MAX_RETRY_AFTER_S = 10.0  # seconds


class EndpointError(LorastackError):
    """The endpoint refused a request or stayed unreachable; `status` is 0 when unreachable."""

    def __init__(self, message: str, hint: str = "", status: int = 0) -> None:
        super().__init__(message, hint)
        self.status = status


def api_root(base_url: str) -> str:
    """'http://h:8000', 'http://h:8000/' and 'http://h:8000/v1' -> 'http://h:8000/v1'."""
    url = base_url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(
            f"base URL {base_url!r} is not an http(s) URL", "give e.g. http://127.0.0.1:8080"
        )
    return url if url.endswith("/v1") else url + "/v1"


def make_client(
    api_key: str | None, timeout_s: float, max_connections: int = 64
) -> httpx.AsyncClient:
    """An HTTP client for an OpenAI-compatible endpoint: the bearer key when given, `timeout_s`
    per request, and no proxy from the environment."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        headers=headers,
        timeout=httpx.Timeout(timeout_s, connect=10.0),
        limits=httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        ),
        trust_env=False,  # never route loopback traffic through a proxy from the environment
    )


def error_text(response: httpx.Response) -> str:
    """The server's own message from an OpenAI-style error body, else the raw text."""
    return error_message(response.text)


def _retry_delay(attempt: int, response: httpx.Response | None) -> float:
    if response is not None and (ra := response.headers.get("retry-after")):
        try:
            return min(float(ra), _MAX_RETRY_AFTER_S)
        except ValueError:
            pass
    return min(0.25 * 2**attempt, 4.0) * (0.5 + random.random())  # seconds, with jitter


async def post_json(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], attempts: int = 3
) -> dict[str, Any]:
    """POST and return the JSON answer, retrying transient failures; raise EndpointError."""
    last = ""
    for attempt in range(attempts):
        response: httpx.Response | None = None
        try:
            response = await client.post(url, json=payload)
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
        else:
            if response.status_code == 200:
                data: dict[str, Any] = response.json()
                return data
            last = f"HTTP {response.status_code}: {error_text(response)}"
            if response.status_code not in RETRY_STATUSES:
                raise EndpointError(
                    f"{url} answered {last}",
                    "check the model name, the API key and the request limits",
                    status=response.status_code,
                )
        if attempt + 1 < attempts:
            await asyncio.sleep(_retry_delay(attempt, response))
    raise EndpointError(
        f"{url} failed after {attempts} tries: {last}",
        "is the server up and reachable? (see its /health)",
    )


async def list_models(client: httpx.AsyncClient, root: str) -> list[str] | None:
    """Model ids from GET /v1/models, or None when the endpoint does not say."""
    try:
        r = await client.get(root + "/models")
        if r.status_code != 200:
            return None
        return [str(m["id"]) for m in r.json().get("data", [])]
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None
