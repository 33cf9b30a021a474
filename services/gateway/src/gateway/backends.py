"""What the gateway knows about its vLLM backends, refreshed in the background.

Every `scrape_interval_s` each backend's `/v1/models` and `/metrics` are read
(concurrently); a backend that fails is marked down and skipped by routing until it
answers again. The model catalog is the union of the models of the backends that are
up. Tokenizers of newly seen base models are loaded in a worker thread here, so the
first request does not pay for it.

With `backends_dns` the set of backends follows DNS: the follower (discovery.py, built and
started beside this in main.py) calls `add`, `drain`, `resume` and `forget`, the only
writers of the set and of a backend's draining state (a draining backend is neither scraped
nor routed to, and its open requests finish); otherwise it is the fixed `backends` list.

Owns: backend state, the model catalog, tokenizer lookup per model (and asks
`declared.py` whether a model no backend lists is a declared adapter being loaded).
Does not own: scoring (routing.py), parsing (scrape.py), proxying (upstream.py), the DNS
lookups and when a backend joins or leaves (discovery.py), which series a backend has
(metrics.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx

from gateway.claims import Claims, InflightCounter
from gateway.declared import DeclaredAdapters
from gateway.errors import (
    BadRequest,
    GatewayError,
    TokenizerUnavailable,
    UnknownModel,
    UpstreamUnavailable,
)
from gateway.metrics import GatewayMetrics
from gateway.routing import BackendView, RouteRequest, fits_kv
from gateway.scrape import BackendMetrics, ModelInfo, probe_embeddings, scrape_backend
from gateway.settings import GatewaySettings
from gateway.tokens import CountingTokenizer, TokenizerCache

log = logging.getLogger(__name__)


@dataclass
class BackendState:
    """What the gateway knows of one backend: its last scrape, models and whether it serves."""

    url: str
    up: bool = False
    models: dict[str, ModelInfo] = field(default_factory=dict)
    metrics: BackendMetrics | None = None
    error: str = "not scraped yet"
    max_num_seqs: int | None = None  # vLLM's running slots (configured: /metrics lacks it)
    sent_at_scrape: int = 0  # the gateway's sent count when the last good scrape began
    embeds: bool | None = None  # serves /v1/embeddings; None = not probed since it came up
    draining: bool = False  # left backends_dns: no new request, open ones finish


class Backends:
    """The backends the gateway routes to: their scraped state, refreshed on a schedule, the
    in-flight counts, declared adapters and tokenizers for their models."""

    def __init__(
        self,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
        tokenizers: TokenizerCache,
        client: httpx.AsyncClient,
        declared: DeclaredAdapters | None = None,
        inflight: Claims | None = None,
    ) -> None:
        self.settings = settings
        self.declared = declared or DeclaredAdapters(settings)
        self.metrics = metrics
        self.tokenizers = tokenizers
        self.client = client
        self.states = {
            url: BackendState(url, max_num_seqs=settings.backend_max_num_seqs.get(url))
            for url in settings.backends
        }
        # this process's counts, or every worker's (`shared_claims.py`)
        self.inflight: Claims = inflight or InflightCounter()
        self.last_refresh = 0.0  # monotonic seconds
        self._refresh_lock = asyncio.Lock()

    # --- refresh -------------------------------------------------------------
    async def _scrape_one(self, st: BackendState) -> None:
        sent = self.inflight.sent.get(st.url, 0)  # requests sent later are not in the scrape
        try:
            st.models, st.metrics = await scrape_backend(self.client, st.url)
            st.sent_at_scrape = sent
            if st.embeds is None:
                st.embeds = await probe_embeddings(self.client, st.url)
            if not st.up:
                log.info("backend %s is up (%s)", st.url, ", ".join(sorted(st.models)))
            st.up, st.error = True, ""
        except (httpx.HTTPError, ValueError) as e:
            if st.up or st.error == "not scraped yet":
                log.warning("backend %s is down: %s", st.url, e)
            st.up, st.error, st.embeds = False, f"{type(e).__name__}: {e}", None
        if self.states.get(st.url) is not st:
            return  # forgotten while it was scraped: leave no series behind
        self.metrics.mirror_backend(st.url, st.up, st.metrics if st.up else None)
        self.metrics.backend_weight.labels(st.url).set(
            self.settings.backend_weights.get(st.url, 1.0)
        )

    async def refresh(self) -> None:
        """Scrape every backend once, then load the tokenizers not loaded yet: those the
        settings map (the serve config's) and those of the models the backends serve."""
        asked = time.monotonic()
        async with self._refresh_lock:
            if self.last_refresh >= asked:
                return  # another caller refreshed while this one waited
            await asyncio.gather(
                *(self._scrape_one(st) for st in self.states.values() if not st.draining)
            )
            self.last_refresh = time.monotonic()
            await self.declared.refresh()
            # the configured ones too, so they load while the backends start
            wanted = dict(self.settings.tokenizers.items())
            wanted |= {info.id: self.tokenizer_source(info) for info in self.catalog().values()}
            for model, source in wanted.items():
                if self.tokenizers.due(source):  # new, or a failed one past its backoff
                    try:
                        await anyio.to_thread.run_sync(self.tokenizers.load, source)
                        log.info("tokenizer for %s loaded from %s", model, source)
                    except GatewayError as e:
                        log.error("tokenizer for %s: %s (retried later)", model, e)

    async def run(self) -> None:
        """The background loop; cancelled when the app stops."""
        while True:
            try:
                await self.refresh()
            except Exception:  # keep refreshing whatever one round did
                log.exception("backend refresh failed")
            await asyncio.sleep(self.settings.scrape_interval_s)

    # --- membership (discovery.py's follower calls these, with backends_dns) ----------
    async def add(self, url: str, max_num_seqs: int | None) -> None:
        """A replica that appeared: scraped at once, routed to once that answers."""
        self.inflight.found(url)
        st = self.states[url] = BackendState(url, max_num_seqs=max_num_seqs)
        await self._scrape_one(st)

    def drain(self, url: str) -> int:
        """Route nothing new to `url`; its open requests finish. Returns how many are open
        (every worker's)."""
        self.states[url].draining = True
        open_requests = self.inflight.counts.get(url, 0)
        self.inflight.draining(url, open_requests)
        return open_requests

    async def resume(self, url: str) -> None:
        """Route to a draining `url` again (it came back) once a scrape answers: it was not
        scraped while it drained, and may have restarted since (other models, KV cache),
        so until then it is unknown, as a new one is."""
        max_num_seqs = self.states[url].max_num_seqs
        st = self.states[url] = BackendState(url, max_num_seqs=max_num_seqs)
        self.inflight.resumed(url)
        await self._scrape_one(st)

    def drained(self) -> list[str]:
        """Draining backends with nothing open on them any more."""
        return [
            url
            for url, st in self.states.items()
            if st.draining and self.inflight.counts.get(url, 0) <= 0
        ]

    def forget(self, url: str) -> None:
        """Drop a drained backend (nothing is open on it any more), its counts and its
        metric series."""
        self.states.pop(url, None)
        self.inflight.forget(url)
        self.metrics.forget_backend(url)

    # --- lookups -------------------------------------------------------------
    def catalog(self) -> dict[str, ModelInfo]:
        """Every model id served by a backend that is up and not draining, with the first
        backend's card for it."""
        out: dict[str, ModelInfo] = {}
        for st in self.states.values():
            if st.up and not st.draining:
                for mid, info in st.models.items():
                    out.setdefault(mid, info)
        return out

    async def model(self, name: str, allowed: Collection[str] | None = None) -> ModelInfo:
        """The model's info; refreshes once (at most every second) before saying 404. The
        404 lists only `allowed` (the caller's key's models; None: every one), so a key
        learns nothing of the models it may not use (callers check permission first)."""
        info = self.catalog().get(name)
        if info is None and time.monotonic() - self.last_refresh > 1.0:
            await self.refresh()
            info = self.catalog().get(name)
        if info is None and not any(st.up for st in self.states.values()):
            down = "; ".join(f"{st.url}: {st.error}" for st in self.states.values())
            if self.settings.backends_dns is not None and not self.states:
                down = f"no replica found at {self.settings.backends_dns}"
            raise UpstreamUnavailable(
                f"no backend is up, so no model is served ({down[:500]})",
                "retry later; check the inference service",
            )
        if info is None:
            await self.declared.refresh(max_age_s=1.0)
            self.declared.check_loading(name)  # declared, not listed yet: 503 Retry-After
            valid = ", ".join(m for m in sorted(self.catalog()) if allowed is None or m in allowed)
            raise UnknownModel(
                f"The model `{name}` does not exist. Valid models: {valid}.",
                "use one of the ids that GET /v1/models lists",
                param="model",
            )
        return info

    def max_model_len(self, info: ModelInfo) -> int:
        """The context length of `info`, else of its parent base model.

        Raises TokenizerUnavailable when neither reports max_model_len."""
        if info.max_model_len:
            return info.max_model_len
        parent = self.catalog().get(info.parent or "")
        if parent is not None and parent.max_model_len:
            return parent.max_model_len
        raise TokenizerUnavailable(
            f"the backend does not report max_model_len for {info.id}",
            "serve it with a vLLM that lists max_model_len in /v1/models",
        )

    def tokenizer_source(self, info: ModelInfo) -> str:
        """Settings map (model, then its base) > the base's `root` if local > store ref."""
        base = info.parent or info.id
        mapped = self.settings.tokenizers
        if info.id in mapped:
            return mapped[info.id]
        if base in mapped:
            return mapped[base]
        base_info = self.catalog().get(base, info)
        if base_info.root and Path(base_info.root).is_dir():
            return base_info.root
        return base

    async def tokenizer_for(self, info: ModelInfo) -> CountingTokenizer:
        """The tokenizer that counts `info`'s prompts, loaded on a worker thread on first use.

        Raises TokenizerUnavailable while a failed load waits out its backoff."""
        source = self.tokenizer_source(info)
        tok = self.tokenizers.get(source)
        if tok is not None:
            return tok
        failed = self.tokenizers.failure(source)
        if failed is not None and not self.tokenizers.due(source):
            raise TokenizerUnavailable(
                f"no tokenizer for {info.id}, so its prompt length cannot be checked:"
                f" {failed.error} (tried {failed.attempts} time(s); retried with backoff)",
                "fix LORASTACK_TOKENIZERS or the store; the gateway retries on its own",
            )
        return await anyio.to_thread.run_sync(self.tokenizers.load, source)

    def require_embeddings(self, model: str) -> None:
        """BadRequest unless a backend that is up serves `model` and embeds."""
        serving = [st for st in self.states.values() if st.up and model in st.models]
        if serving and not any(st.embeds for st in serving):
            raise BadRequest(
                f"the model `{model}` does not serve embeddings: its backends run it to"
                " generate text.",
                "ask an embedding model (GET /v1/models lists the models), or serve one"
                " with vLLM's pooling runner behind this gateway",
                param="model",
            )

    def pending_tokenizers(self) -> list[str]:
        """Models whose tokenizer is neither loaded nor failed yet (the gateway is not ready)."""
        return [
            m.id
            for m in self.catalog().values()
            if self.tokenizers.get(self.tokenizer_source(m)) is None
            and self.tokenizers.failure(self.tokenizer_source(m)) is None
        ]

    def failed_tokenizers(self) -> dict[str, str]:
        """Model -> why its tokenizer failed to load (retried with backoff): while any model
        served has none, the gateway is not ready (its requests would answer 503)."""
        out = {}
        for m in self.catalog().values():
            failed = self.tokenizers.failure(self.tokenizer_source(m))
            if failed is not None:
                out[m.id] = failed.error
        return out

    def block_size(self, url: str) -> int:
        """Tokens per KV block of the backend at `url`, as last scraped."""
        return (self.states[url].metrics or BackendMetrics()).block_size

    def still_fits(self, req: RouteRequest, url: str) -> bool:
        """Whether `req`'s KV claim fits on `url` beside the claims counted now (`fits_kv`),
        and `url` still takes requests: exact while the count's lock is held, where
        `Admission` confirms a pick made without it."""
        st = self.states.get(url)
        if st is None or not st.up or st.draining:
            return False
        m = st.metrics or BackendMetrics()
        n, tokens = self.inflight.claimed(url)
        view = BackendView(
            url,
            inflight=n,
            inflight_tokens=tokens,
            kv_capacity_tokens=m.kv_capacity_tokens,
            block_size=m.block_size,
        )
        return fits_kv(req, view)

    def views(self) -> list[BackendView]:
        """Each backend as routing sees it (`BackendView`): health, load, adapters, claims."""
        out = []
        for st in self.states.values():
            m = st.metrics or BackendMetrics()
            inflight = self.inflight.counts.get(st.url, 0)
            out.append(
                BackendView(
                    url=st.url,
                    healthy=st.up and not st.draining,
                    models=frozenset(st.models),
                    kv_usage=m.kv_usage,
                    running=m.running,
                    waiting=m.waiting,
                    loaded_adapters=m.running_adapters | m.waiting_adapters,
                    max_lora=m.max_lora,
                    inflight=inflight,
                    max_num_seqs=st.max_num_seqs,
                    embeds=bool(st.embeds),
                    # sent after the scrape and still open (an answered one holds no slot)
                    sent_since_scrape=min(
                        inflight, self.inflight.sent.get(st.url, 0) - st.sent_at_scrape
                    ),
                    kv_capacity_tokens=m.kv_capacity_tokens,
                    block_size=m.block_size,
                    inflight_tokens=self.inflight.tokens.get(st.url, 0),
                    weight=self.settings.backend_weights.get(st.url, 1.0),
                )
            )
        return out
