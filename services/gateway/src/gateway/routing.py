"""Pure routing: score backends for a request from plain scraped data, then pick one.

Each scorer maps `{backend url: score in 0..1}` (1 = best) and is a small plugin for one
concern: KV-cache usage, capacity (free running slots, then the queue), LoRA affinity,
prefix-cache affinity (the replica that last served the prompt's leading blocks), session
affinity (the replica the session used last) and the operator's static weight of each
backend (a larger GPU among smaller ones). `pick_backend` drops unhealthy
backends, those the request's claim is too large for (`within_share`: a 400), those where
requests that came earlier wait for room (the lines of `claims.py`), and saturated ones
(admission control: the KV cache this gateway has itself claimed there, `fits_kv`, then
the scraped usage as the correction), then backends with no free slot while another has
one (so no request waits in a queue next to an idle slot), combines the scores with
weights and breaks ties by the gateway's own in-flight count, then by URL, so the result
is deterministic. No I/O here; the tables behind the affinities live in `affinity.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from gateway.errors import KvClaimTooLarge, NoKvRoom, Overloaded, UpstreamUnavailable


@dataclass(frozen=True)
class BackendView:
    """What routing knows of one backend (from its last scrape plus the gateway's count)."""

    url: str
    healthy: bool = True
    models: frozenset[str] = frozenset()
    kv_usage: float | None = None  # 0..1; None = not scraped yet
    running: int = 0
    waiting: int = 0
    loaded_adapters: frozenset[str] = frozenset()  # running or waiting LoRA adapters
    max_lora: int = 0
    inflight: int = 0  # requests this gateway has open on it now (fresher than a scrape)
    max_num_seqs: int | None = None  # vLLM's running slots; None = not known
    embeds: bool = False  # serves /v1/embeddings (its model is an embedding model)
    sent_since_scrape: int = 0  # requests the gateway sent it after its last scrape
    # KV cache vLLM allocated (`vllm:cache_config_info`: num_gpu_blocks x block_size);
    # None = not reported (then only the scraped usage admits)
    kv_capacity_tokens: int | None = None
    block_size: int = 16  # tokens per KV block
    # KV claims of the requests counted in `inflight`: tokens, whole blocks (`kv_claim`)
    inflight_tokens: int = 0
    # the operator's static weight of this backend (`backend_weights`; > 0, 1 = unlisted):
    # a replica on a larger GPU among smaller ones is given more
    weight: float = 1.0


@dataclass(frozen=True)
class RouteRequest:
    """What routing knows of a request: model, kind, affinity hints and its KV claim."""

    model: str
    adapter: bool = False  # the model is a LoRA adapter (it has a parent)
    embed: bool = False  # an embeddings request: only backends that embed serve it
    session_backend: str | None = None  # the replica this request's session used last
    prefix_blocks: int = 0  # leading prompt blocks hashed (affinity.py)
    # backend url -> how many of those leading blocks it served last
    prefix_hits: Mapping[str, int] = field(default_factory=dict)
    # tokens, prompt + max output, of each sequence vLLM runs for it (one per prompt and
    # choice): the most KV cache it can take; empty = no claim
    sequences: tuple[int, ...] = ()


@dataclass(frozen=True)
class Thresholds:
    """When a backend counts as saturated (KV usage and waiting requests both at these), and
    the share of its KV cache one request may claim."""

    max_kv_usage: float = 0.95  # 0..1
    max_waiting: int = 8  # requests
    # the most of a backend's KV cache (0..1) one request of several sequences may claim
    kv_request_share: float = 0.5


@dataclass(frozen=True)
class Weights:
    """The weight of each scorer in `score_combined`."""

    kv: float = 1.0
    capacity: float = 1.0
    lora: float = 2.0  # a miss costs an adapter load (and may evict another)
    # a cache hit saves the prefill of the matched blocks: outweighs any KV/capacity gap
    # among backends with a free slot (those without one are dropped before scoring)
    prefix: float = 2.0
    session: float = 4.0  # sticks unless the replica is down, saturated or full
    static: float = 1.0  # the backends' static weights (`score_static`)


Scorer = Callable[[RouteRequest, list[BackendView]], dict[str, float]]


def score_kv_usage(req: RouteRequest, views: list[BackendView]) -> dict[str, float]:
    """Free KV cache; an unscraped backend counts as half full."""
    return {
        v.url: 1.0 - min(1.0, max(0.0, 0.5 if v.kv_usage is None else v.kv_usage)) for v in views
    }


def free_slots(v: BackendView) -> int | None:
    """Running slots left; None when unknown.

    Taken: the scrape's running plus what was sent since, or this gateway's own open
    requests less the scrape's waiting, whichever is more. vLLM counts a request as running
    or waiting only once its API server has taken it in (hundreds of ms on a busy CPU), so
    a scrape in between reads a slot as free that a request on its way already holds; the
    gateway's open requests still hold it.
    """
    if v.max_num_seqs is None or v.max_num_seqs <= 0:
        return None
    return v.max_num_seqs - max(v.running + v.sent_since_scrape, v.inflight - v.waiting)


def is_full(v: BackendView) -> bool:
    """A new request would wait in its queue: something waits already, or no slot is free."""
    free = free_slots(v)
    return v.waiting > 0 or (free is not None and free <= 0)


def score_capacity(req: RouteRequest, views: list[BackendView]) -> dict[str, float]:
    """Free running slots first, then the shortest queue.

    free = max_num_seqs - running - requests sent since the scrape (those will take a slot
    or wait), or less by the gateway's own open requests (`free_slots`). A backend with a
    free slot and nothing waiting scores 0.5..1 (more free slots, higher); any other
    0..0.5, by what would wait ahead of this request per running slot (a queue of 3 behind
    8 slots moves sooner than 1 behind 1). So a replica busy *running* requests but with a
    slot left beats one whose requests *wait*, whatever the sizes. Unknown `max_num_seqs`:
    the queue alone, in the lower half.
    """
    out = {}
    for v in views:
        free = free_slots(v)
        if free is None or v.max_num_seqs is None:
            out[v.url] = 0.5 / (1.0 + v.waiting + v.sent_since_scrape)
        elif free > 0 and v.waiting == 0:
            out[v.url] = 0.5 + 0.5 * free / v.max_num_seqs
        else:
            out[v.url] = 0.5 / (1.0 + (v.waiting + max(0, -free)) / v.max_num_seqs)
    return out


def score_lora_affinity(req: RouteRequest, views: list[BackendView]) -> dict[str, float]:
    """1 when the adapter is already loaded, 0.5 when a LoRA slot is free, else 0."""
    if not req.adapter:
        return {v.url: 1.0 for v in views}
    out = {}
    for v in views:
        if req.model in v.loaded_adapters:
            out[v.url] = 1.0
        elif len(v.loaded_adapters) < max(v.max_lora, 1):
            out[v.url] = 0.5
        else:
            out[v.url] = 0.0
    return out


def score_prefix(req: RouteRequest, views: list[BackendView]) -> dict[str, float]:
    """The share of the prompt's leading blocks a backend served last (its prefix cache
    likely still holds them); neutral (1 everywhere) when the prompt has no full block."""
    if req.prefix_blocks <= 0:
        return {v.url: 1.0 for v in views}
    return {
        v.url: min(req.prefix_hits.get(v.url, 0), req.prefix_blocks) / req.prefix_blocks
        for v in views
    }


def score_session(req: RouteRequest, views: list[BackendView]) -> dict[str, float]:
    """1 for the replica the session used last, 0 for the others; neutral without one
    (or when that replica is not among the candidates: down, saturated or full)."""
    if req.session_backend is None or all(v.url != req.session_backend for v in views):
        return {v.url: 1.0 for v in views}
    return {v.url: 1.0 if v.url == req.session_backend else 0.0 for v in views}


def score_static(req: RouteRequest, views: list[BackendView]) -> dict[str, float]:
    """Each backend's static weight over the largest among the candidates (1 for the
    largest); neutral (1 everywhere) when every weight is the same."""
    top = max((v.weight for v in views), default=1.0)
    return {v.url: v.weight / top for v in views}


def score_combined(
    req: RouteRequest, views: list[BackendView], weights: Weights = Weights()
) -> dict[str, float]:
    """Each backend's weighted mean of the scorers (KV, capacity, LoRA, prefix, session,
    static weight), 0..1."""
    parts: list[tuple[float, Scorer]] = [
        (weights.kv, score_kv_usage),
        (weights.capacity, score_capacity),
        (weights.lora, score_lora_affinity),
        (weights.prefix, score_prefix),
        (weights.session, score_session),
        (weights.static, score_static),
    ]
    total = sum(w for w, _ in parts) or 1.0
    scores = {v.url: 0.0 for v in views}
    for w, scorer in parts:
        for url, s in scorer(req, views).items():
            scores[url] += w * s / total
    return scores


def is_saturated(v: BackendView, t: Thresholds) -> bool:
    """Whether the backend's KV usage and waiting queue are both at their thresholds."""
    return v.kv_usage is not None and v.kv_usage >= t.max_kv_usage and v.waiting >= t.max_waiting


def kv_claim(req: RouteRequest, block_size: int) -> int:
    """Tokens of KV cache `req` can take at most: each sequence rounded up to whole blocks,
    as vLLM allocates them (a batched prompt or an `n > 1` choice is a sequence of its own)."""
    return sum(-(-tokens // block_size) * block_size for tokens in req.sequences)


def kv_claimed(v: BackendView) -> int:
    """Tokens of KV cache this gateway's open requests on `v` can take at most (`kv_claim`).
    Other clients (or gateway replicas) are not in it: the scraped usage (`is_saturated`)
    corrects for them; mixed in here, a 2-s-old scrape of requests already finished would
    refuse requests that fit."""
    return v.inflight_tokens


def fits_kv(req: RouteRequest, v: BackendView) -> bool:
    """The request's whole claim (`kv_claim`) fits beside what is claimed already, so vLLM
    never has to preempt a running request to make room.

    Counted by the gateway as it sends, not read from a scrape: requests arriving together
    would all pass the same seconds-old scrape and make vLLM preempt (issue 39). One
    block of vLLM's pool is its null block. A backend with nothing open takes any request
    (one that can never fit is vLLM's to refuse, by max_model_len)."""
    if v.kv_capacity_tokens is None or not req.sequences or v.inflight == 0:
        return True
    usable = v.kv_capacity_tokens - v.block_size  # the null block
    return kv_claimed(v) + kv_claim(req, v.block_size) <= usable


def within_share(req: RouteRequest, v: BackendView, share: float) -> bool:
    """Whether `req`'s claim may ever be admitted on `v`: at most `share` of its KV cache.

    A request of one sequence is exempt: vLLM sizes its cache for at least one sequence of
    max_model_len, and the length check already holds that sequence to max_model_len. One
    of several (`n > 1`, a batch of prompts) claims them all at once, and is the request
    that would otherwise be admitted alone and leave no room to anyone while it runs."""
    if len(req.sequences) <= 1 or v.kv_capacity_tokens is None:
        return True
    return kv_claim(req, v.block_size) <= share * v.kv_capacity_tokens


def candidates(req: RouteRequest, views: list[BackendView], share: float) -> list[BackendView]:
    """The backends that could take `req` once room is given back: up, serving its model
    (embedding if it embeds), and large enough for its claim (`within_share`).

    Raises UpstreamUnavailable when no backend serves it, KvClaimTooLarge when its claim
    is over the share of every backend that does."""
    serving = [
        v for v in views if v.healthy and req.model in v.models and (v.embeds or not req.embed)
    ]
    if not serving:
        raise UpstreamUnavailable(
            f"no healthy backend serves {req.model!r} right now",
            "check the inference service; the gateway retries its backends every few seconds",
        )
    sized = [v for v in serving if within_share(req, v, share)]
    if not sized:
        largest = max(serving, key=lambda v: v.kv_capacity_tokens or 0)
        capacity = largest.kv_capacity_tokens or 0
        limit = int(share * capacity)
        longest = max(req.sequences)
        raise KvClaimTooLarge(
            f"this request would claim {kv_claim(req, largest.block_size)} tokens of KV cache"
            f" at once: {len(req.sequences)} sequences (n x prompts) of up to {longest} tokens"
            f" (prompt + max_tokens), but one request may claim at most {limit} tokens,"
            f" {share:g} of the {capacity}-token KV cache of the largest backend serving"
            f" {req.model!r} (kv_request_share), so that it never shuts other requests out.",
            f"lower n or max_tokens so that n x (prompt + max_tokens) <= {limit} tokens, send"
            " fewer prompts per request, or raise LORASTACK_KV_REQUEST_SHARE",
            param="n",
        )
    return sized


def pick_backend(
    req: RouteRequest,
    views: list[BackendView],
    *,
    thresholds: Thresholds = Thresholds(),
    weights: Weights = Weights(),
    avoid: Collection[str] = (),
    blocked: Collection[str] = (),
    retry_after_s: float = 1.0,
) -> str:
    """The best backend for `req`; `avoid` (already tried) is used only when nothing else
    is left; `blocked` (where requests that came earlier wait for KV room) is never used.

    Raises UpstreamUnavailable or KvClaimTooLarge (`candidates`), NoKvRoom (no room on
    any candidate), Overloaded (every candidate with room saturated)."""
    serving = candidates(req, views, thresholds.kv_request_share)
    roomy = [v for v in serving if v.url not in blocked and fits_kv(req, v)]
    if not roomy:
        full = ", ".join(
            f"{v.url}: requests that came earlier wait for room there"
            if v.url in blocked
            else f"{v.url}: {kv_claimed(v)} of {v.kv_capacity_tokens} tokens claimed"
            for v in serving
        )
        raise NoKvRoom(
            f"no KV-cache room for this request's {sum(req.sequences)} tokens (prompt + max"
            f" output, {len(req.sequences)} sequence(s)) on any backend serving"
            f" {req.model!r} ({full})",
            "retry after the Retry-After delay, lower max_tokens, or add replicas",
            retry_after_s=retry_after_s,
        )
    open_ = [v for v in roomy if not is_saturated(v, thresholds)]
    if not open_:
        raise Overloaded(
            f"every backend serving {req.model!r} is saturated (KV-cache usage >="
            f" {thresholds.max_kv_usage:.0%} and >= {thresholds.max_waiting} requests waiting)",
            "retry after the Retry-After delay, or add replicas",
            retry_after_s=retry_after_s,
        )
    fresh = [v for v in open_ if v.url not in avoid] or open_
    fresh = [v for v in fresh if not is_full(v)] or fresh
    if len(fresh) == 1:  # one candidate (one replica per model is common): nothing to score
        return fresh[0].url
    scores = score_combined(req, fresh, weights)
    by_url: Mapping[str, BackendView] = {v.url: v for v in fresh}
    return min(scores, key=lambda u: (-round(scores[u], 9), by_url[u].inflight, u))
