"""Replays a parity reference (lorastack.parity) through vLLM and judges what comes back.

Owns the HTTP side of the check: for each probe, vLLM's `/tokenize` renders the probe's
messages with the chat template the server uses and encodes the recorded prompt text
with the server's tokenizer; `/v1/completions` decodes greedily from the server's own
rendering and teacher-forces the recorded answer (`replay_probe`). Probes go to vLLM at
once, so it batches them. vLLM's errors become EngineFailed. The verdict itself is
lorastack.parity.judge; `check_folder` is the supervisor's use of it.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from inference.errors import EngineFailed
from lorastack.error_body import error_message
from lorastack.parity import REFERENCE_FILE, Policy, ProbeRecord, Reference, Replay, Verdict, judge

log = logging.getLogger(__name__)


def read_reference(folder: Path) -> Reference | None:
    """The reference an artifact folder carries; None when it has none (made before
    references were recorded, or with parity_probes: 0). A damaged one is an error."""
    path = folder / REFERENCE_FILE
    if not path.is_file():
        return None
    try:
        return Reference.model_validate_json(path.read_bytes())
    except ValidationError as e:
        raise EngineFailed(
            f"{path} is not a parity reference: {e.errors()[0]['msg']}",
            "publish the artifact again from its run (the trainer writes it)",
        ) from None


class _Vllm:
    def __init__(self, base_url: str, model: str, api_key: str | None, timeout_s: float) -> None:
        self.base_url, self.model, self.timeout_s = base_url, model, timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            r = httpx.post(
                f"{self.base_url}{path}",
                json={"model": self.model, **body},
                headers=self.headers,
                timeout=self.timeout_s,
            )
        except httpx.HTTPError as e:
            raise EngineFailed(f"parity check: vLLM did not answer {path}: {e}", "retry") from e
        if r.status_code != 200:
            raise EngineFailed(
                f"parity check: vLLM answered {path} with {r.status_code}: {error_message(r.text)}",
                "see the vLLM log",
            )
        data: dict[str, Any] = r.json()
        return data

    def tokens(self, body: dict[str, Any]) -> list[int]:
        return [
            int(t) for t in self.post("/tokenize", {"add_special_tokens": False, **body})["tokens"]
        ]


TOP_LOGPROBS = 5  # alternatives vLLM returns per position (its max_logprobs is 20)


def _steps(answer: dict[str, Any]) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Per choice: the generated token ids and, per position, the most likely tokens' ids
    and log-probabilities (`return_tokens_as_token_ids` writes tokens as "token_id:N")."""

    def token_id(text: str) -> int:
        return int(str(text).rpartition(":")[2])

    out = []
    for choice in sorted(answer["choices"], key=lambda c: int(c["index"])):
        lp = choice["logprobs"]
        tops = [
            {token_id(t): float(v) for t, v in (top or {}).items()} for top in lp["top_logprobs"]
        ]
        out.append(([token_id(t) for t in lp["tokens"]], tops))
    return out


def _forced_at(top: dict[int, float], token: int, chosen: int) -> tuple[float, bool]:
    """The log-probability of `token` where the server chose `chosen`, and whether it was
    the server's top-1. A token outside the top TOP_LOGPROBS gets the least of them: its
    own is lower still, so the |Δ| reported is a lower bound."""
    return top.get(token, min(top.values(), default=float("-inf"))), token == chosen


def replay_probe(vllm: _Vllm, probe: ProbeRecord) -> Replay:
    """The server's answers for one probe. Greedy decoding from the recorded prompt gives
    the teacher-forced figures for free while it follows the recorded answer (the same
    prefixes; it is the greedy decoding from the server's own rendering when the two
    prompts agree); the positions after the two part are asked one prefix each, in one
    batched request.
    (No `prompt_logprobs`: vLLM 0.32's CPU LoRA kernels fail on it and kill the engine.)"""
    chat: dict[str, Any] = {"messages": probe.messages, "add_generation_prompt": True}
    if probe.tools:
        chat["tools"] = probe.tools
    rendered = vllm.tokens(chat)
    encoded = vllm.tokens({"prompt": probe.prompt_text})
    asked = {"temperature": 0, "logprobs": TOP_LOGPROBS, "return_tokens_as_token_ids": True}
    wanted = probe.output_ids

    def decode(prompt: list[int]) -> tuple[list[int], list[dict[int, float]]]:
        body = {"prompt": prompt, "max_tokens": len(wanted), **asked}
        [(ids, tops)] = _steps(vllm.post("/v1/completions", body))
        return ids, tops

    greedy, tops = decode(rendered)
    on_track, track = (greedy, tops) if rendered == probe.prompt_ids else decode(probe.prompt_ids)
    same = 0
    while same < min(len(on_track), len(wanted)) and on_track[same] == wanted[same]:
        same += 1
    forced = [_forced_at(track[i], wanted[i], on_track[i]) for i in range(same)]
    if same < len(wanted):
        prefixes = [probe.prompt_ids + wanted[:i] for i in range(same, len(wanted))]
        answer = vllm.post("/v1/completions", {"prompt": prefixes, "max_tokens": 1, **asked})
        forced += [
            _forced_at(top[0], wanted[i], ids[0])
            for i, (ids, top) in zip(range(same, len(wanted)), _steps(answer), strict=True)
        ]
    return Replay(
        rendered_ids=rendered,
        encoded_ids=encoded,
        forced_logprobs=[lp for lp, _ in forced],
        forced_top1=[top1 for _, top1 in forced],
        greedy_ids=greedy,
    )


def check(
    base_url: str,
    model: str,
    reference: Reference,
    *,
    served_dtype: str,
    served_base_digest: str = "",
    policy: Policy | None = None,
    api_key: str | None = None,
    timeout_s: float = 120.0,
) -> Verdict:
    """Replay `reference` through the vLLM at `base_url` as `model` and judge it."""
    vllm = _Vllm(base_url, model, api_key, timeout_s)
    with ThreadPoolExecutor(max_workers=min(8, len(reference.probes))) as pool:
        replays = list(pool.map(lambda p: replay_probe(vllm, p), reference.probes))
    return judge(
        model,
        reference,
        replays,
        served_dtype=served_dtype,
        served_base_digest=served_base_digest,
        policy=policy,
    )


@dataclass(frozen=True)
class Outcome:
    record: dict[str, Any] | None  # for /status and /metrics; None: parity is off
    refused: str  # why it must not be served; "" when it may


def check_folder(
    folder: Path,
    *,
    base_url: str,
    served_name: str,
    served_dtype: str,
    served_base_digest: str,
    setting: str,
    api_key: str | None,
) -> Outcome:
    """The supervisor's parity check of one served model or adapter: replay the reference
    `folder` carries, say the verdict in the log, and apply `setting` (auto | refuse | warn |
    off, InferenceSettings.parity). Without a reference, or when vLLM cannot be asked, it
    is served and /status says why nothing was checked."""
    if setting == "off":
        return Outcome(None, "")
    reference = read_reference(folder)
    if reference is None:
        return Outcome({"model": served_name, "ok": None, "reference": None}, "")
    try:
        verdict = check(
            base_url,
            served_name,
            reference,
            served_dtype=served_dtype,
            served_base_digest=served_base_digest,
            policy=None if setting == "auto" else setting,  # type: ignore[arg-type]
            api_key=api_key,
        )
    except EngineFailed as e:
        log.warning("parity of %s not checked: %s", served_name, e.message)
        return Outcome({"model": served_name, "ok": None, "error": e.message}, "")
    if verdict.ok:
        log.info("%s", verdict.summary())
        return Outcome(verdict.as_dict(), "")
    refuse = verdict.policy == "refuse"
    log.log(
        logging.ERROR if refuse else logging.WARNING,
        "%s: %s",
        verdict.summary(),
        "; ".join(verdict.problems),
    )
    reason = f"{served_name} differs from the model that was trained: {verdict.problems[0]}"
    return Outcome(verdict.as_dict(), reason if refuse else "")
