"""Replays a parity reference (lorastack.parity) through vLLM and judges what comes back.

Owns the HTTP side of the check: for each probe, vLLM's `/tokenize` renders the probe's
messages with the chat template the server uses and encodes the recorded prompt text
with the server's tokenizer; `/v1/completions` decodes greedily from the server's own
rendering and teacher-forces the recorded answer (`replay_probe`). Probes go to vLLM at
once, so it batches them. vLLM's errors become EngineFailed. The verdict itself is
lorastack.parity.judge; `ParityChecks` is the supervisor's use of it.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from inference import vllm_api
from inference.errors import EngineFailed
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
    """vLLM's API as the replay asks it: one served model, its key, one timeout."""

    def __init__(self, base_url: str, model: str, api_key: str | None, timeout_s: float) -> None:
        self.base_url, self.model, self.api_key, self.timeout_s = (
            base_url,
            model,
            api_key,
            timeout_s,
        )

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return vllm_api.post_json(
            self.base_url,
            path,
            {"model": self.model, **body},
            api_key=self.api_key,
            timeout_s=self.timeout_s,
        )

    def tokens(self, body: dict[str, Any]) -> list[int]:
        answer = self.post("/tokenize", {"add_special_tokens": False, **body})
        return [int(t) for t in answer["tokens"]]


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


def _forced_at(top: dict[int, float], token: int, chosen: int) -> tuple[float, bool, float | None]:
    """The log-probability of `token` where the server chose `chosen`, whether it was the
    server's top-1, and by how much the server preferred `chosen` (None when `token` is not
    among the top TOP_LOGPROBS). A token outside them gets the least of them: its own is
    lower still, so the |Δ| reported is a lower bound."""
    if token not in top:
        return min(top.values(), default=float("-inf")), False, None
    return top[token], token == chosen, top.get(chosen, top[token]) - top[token]


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
        forced_logprobs=[lp for lp, _, _ in forced],
        forced_top1=[top1 for _, top1, _ in forced],
        greedy_ids=greedy,
        forced_margins=[margin for _, _, margin in forced],
    )


def served_quantization(engine_args: list[str]) -> str:
    """How vLLM quantises the base as it loads it, from its arguments: `--quantization
    bitsandbytes` quantises in flight to nf4 (vLLM 0.26's bitsandbytes_loader:
    `quantize_4bit(quant_type="nf4", compress_statistics=True)`, the 4-bit weights QLoRA
    trains against); another method by its name; none without the flag. A scan, not vLLM's
    own parser: the supervisor runs vLLM as a process and need not import it."""
    method = "none"
    for i, arg in enumerate(engine_args):
        if arg.startswith("--quantization="):
            method = arg.partition("=")[2]
        elif arg in ("--quantization", "-q") and i + 1 < len(engine_args):
            method = engine_args[i + 1]
    return "nf4" if method == "bitsandbytes" else method


def check(
    base_url: str,
    model: str,
    reference: Reference,
    *,
    served_dtype: str,
    served_quantization: str = "none",
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
        served_quantization=served_quantization,
        served_base_digest=served_base_digest,
        policy=policy,
    )


class ParityChecks:
    """The parity checks of one supervisor: each served model or adapter replayed against
    the reference its folder carries, `setting` applied (auto | refuse | warn | off,
    InferenceSettings.parity), the verdicts kept for /status and /metrics. Without a
    reference, or when vLLM cannot be asked, it is served and the record says why nothing
    was checked."""

    def __init__(
        self,
        setting: str,
        *,
        served_dtype: str,
        api_key: str | None,
        served_quantization: str = "none",
    ) -> None:
        self.setting, self.served_dtype, self.api_key = setting, served_dtype, api_key
        self.served_quantization = served_quantization
        self._lock = threading.Lock()
        self._results: dict[str, dict[str, Any]] = {}  # served name -> Verdict.as_dict() or why not

    def results(self) -> dict[str, dict[str, Any]]:
        """A copy of the verdicts so far, by served name."""
        with self._lock:
            return dict(self._results)

    def check(
        self, base_url: str, served_name: str, folder: Path, *, served_base_digest: str = ""
    ) -> str:
        """Check what vLLM at `base_url` serves as `served_name`; returns why it must not be
        served ("" when it may). `served_base_digest`: the base an adapter runs on."""
        if self.setting == "off":
            return ""
        record, refused = self._judge(base_url, served_name, folder, served_base_digest)
        with self._lock:
            self._results[served_name] = record
        return refused

    def _judge(
        self, base_url: str, served_name: str, folder: Path, served_base_digest: str
    ) -> tuple[dict[str, Any], str]:
        reference = read_reference(folder)
        if reference is None:
            return {"model": served_name, "ok": None, "reference": None}, ""
        try:
            verdict = check(
                base_url,
                served_name,
                reference,
                served_dtype=self.served_dtype,
                served_quantization=self.served_quantization,
                served_base_digest=served_base_digest,
                policy=None if self.setting == "auto" else self.setting,  # type: ignore[arg-type]
                api_key=self.api_key,
            )
        except EngineFailed as e:
            log.warning("parity of %s not checked: %s", served_name, e.message)
            return {"model": served_name, "ok": None, "error": e.message}, ""
        if verdict.ok:
            log.info("%s", verdict.summary())
            return verdict.as_dict(), ""
        refuse = verdict.policy == "refuse"
        problems = "; ".join(verdict.problems)
        log.log(logging.ERROR if refuse else logging.WARNING, "%s: %s", verdict.summary(), problems)
        reason = f"{served_name} differs from the model that was trained: {verdict.problems[0]}"
        return verdict.as_dict(), reason if refuse else ""
