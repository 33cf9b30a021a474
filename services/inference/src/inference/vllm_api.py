"""The supervisor's HTTP calls to its vLLM: warm-up, metrics, runtime LoRA load/unload, and
the JSON requests of the parity check (inference.parity).

vLLM's answers are turned into `EngineFailed` here (with vLLM's own message), so the
supervisor and the routes never see raw HTTP errors.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from inference.errors import EngineFailed
from lorastack.error_body import error_message


def _message(r: httpx.Response) -> str:
    return error_message(r.text)


def _auth(api_key: str | None) -> dict[str, str]:
    """vLLM's --api-key guards every /v1/* route (load_lora_adapter too), not /metrics."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def post_json(
    base_url: str, path: str, body: dict[str, object], *, api_key: str | None, timeout_s: float
) -> dict[str, Any]:
    """POST `body` to vLLM and return its JSON answer; no answer or not 200: EngineFailed."""
    try:
        r = httpx.post(f"{base_url}{path}", json=body, headers=_auth(api_key), timeout=timeout_s)
    except httpx.HTTPError as e:
        raise EngineFailed(f"vLLM did not answer {path}: {e}", "retry") from e
    if r.status_code != 200:
        raise EngineFailed(
            f"vLLM answered {path} with {r.status_code}: {_message(r)}", "see the vLLM log"
        )
    data: dict[str, Any] = r.json()
    return data


def warm_up(
    base_url: str, model: str, timeout_s: float = 120.0, *, api_key: str | None = None
) -> None:
    """One tiny completion end to end (tokenizer, scheduler, model, sampler)."""
    try:
        r = httpx.post(
            f"{base_url}/v1/completions",
            json={"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0},
            headers=_auth(api_key),
            timeout=timeout_s,
        )
    except httpx.HTTPError as e:
        raise EngineFailed(f"warm-up request failed: {e}", "see the vLLM log") from e
    if r.status_code != 200:
        raise EngineFailed(f"warm-up answered {r.status_code}: {_message(r)}", "see the vLLM log")


def get_metrics(base_url: str, timeout_s: float = 5.0) -> str:
    """vLLM's /metrics text ("" when it does not answer 200)."""
    try:
        r = httpx.get(f"{base_url}/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return ""
    return r.text if r.status_code == 200 else ""


BUSY_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def busy_requests(metrics_text: str) -> int:
    """Requests vLLM runs or queues now, from its /metrics text (summed over engines)."""
    from prometheus_client.parser import text_string_to_metric_families

    return int(
        sum(
            s.value
            for family in text_string_to_metric_families(metrics_text)
            for s in family.samples
            if s.name in BUSY_METRICS
        )
    )


def wait_idle(base_url: str, timeout_s: float, poll_s: float = 0.2) -> int:
    """Poll vLLM's /metrics until it runs and queues nothing, at most `timeout_s` seconds;
    returns the requests still open (0 when it emptied)."""
    deadline = time.monotonic() + timeout_s
    while (busy := busy_requests(get_metrics(base_url))) > 0 and time.monotonic() < deadline:
        time.sleep(poll_s)
    return busy


def _adapter_call(
    base_url: str,
    action: str,
    body: dict[str, object],
    *,
    timeout_s: float,
    api_key: str | None,
    hint: str,
) -> None:
    """POST vLLM's /v1/{action}_lora_adapter (action: load or unload); EngineFailed when
    it does not answer, or refuses (502, `hint` says what to check)."""
    try:
        r = httpx.post(
            f"{base_url}/v1/{action}_lora_adapter",
            json=body,
            headers=_auth(api_key),
            timeout=timeout_s,
        )
    except httpx.HTTPError as e:
        raise EngineFailed(f"vLLM did not answer the adapter {action}: {e}", "retry") from e
    if r.status_code != 200:
        raise EngineFailed(
            f"vLLM refused to {action} {body['lora_name']} ({r.status_code}): {_message(r)}",
            hint,
            status=502,
        )


def load_lora(
    base_url: str,
    served_name: str,
    path: Path,
    *,
    inplace: bool = False,
    timeout_s: float = 120.0,
    api_key: str | None = None,
) -> None:
    """Load an adapter; `inplace` replaces the one of the same name (vLLM's load_inplace)."""
    body: dict[str, object] = {"lora_name": served_name, "lora_path": str(path)}
    if inplace:
        body["load_inplace"] = True
    _adapter_call(
        base_url,
        "load",
        body,
        timeout_s=timeout_s,
        api_key=api_key,
        hint="check the adapter matches the served model and max_lora_rank",
    )


def unload_lora(
    base_url: str, served_name: str, timeout_s: float = 60.0, *, api_key: str | None = None
) -> None:
    """Unload a LoRA adapter from a running vLLM."""
    _adapter_call(
        base_url,
        "unload",
        {"lora_name": served_name},
        timeout_s=timeout_s,
        api_key=api_key,
        hint="list loaded adapters on /status",
    )
