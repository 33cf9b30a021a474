"""The gateway's one settings class, built once at start and passed down.

Environment variables use the shared prefix `LORASTACK_` (e.g. `LORASTACK_BACKENDS`,
`LORASTACK_API_KEYS`). List fields accept JSON or a comma-separated string; the tokenizer
map accepts JSON or `model=source,model=source`.

Secrets are checked here, so a bad deploy fails at start (lorastack.secrets): auth is on
whenever keys are configured (`auth_enabled` unset follows the keys; `false` with keys is
refused: nothing is silently ignored), an API key or admin key is at least 32 characters
and no placeholder (unset admin key: the admin views are off; the metrics key likewise:
unset, /metrics is refused while clients need keys), and a bind to anything but loopback without
auth is refused unless `gateway_allow_unauthenticated` says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode

from gateway.serve_config import served_max_num_seqs, served_tokenizers
from gateway.settings_parsing import (
    base_url,
    dns_target,
    is_loopback,
    nameserver,
    split_alias,
    split_list,
    split_map,
)
from lorastack.secrets import ADMIN_KEY_MIN_CHARS, API_KEY_MIN_CHARS, secret_problem
from lorastack.settings import CommonSettings


class GatewaySettings(CommonSettings):
    """The gateway's settings (LORASTACK_ env vars), checked at start."""

    host: str = Field("127.0.0.1", description="address uvicorn binds")
    port: int = Field(8080, ge=1, le=65535)
    backends: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["http://127.0.0.1:8000"],
        description="vLLM base URLs (without /v1); a fixed list (compose). With backends_dns"
        " the replicas are found by DNS instead and this must stay unset",
    )
    backends_dns: str | None = Field(
        None,
        description="NAME:PORT of a headless Service (e.g."
        " inference.lorastack.svc.cluster.local:8000): every A record of NAME is a backend"
        " http://ADDRESS:PORT, looked up every backends_dns_interval_s; a replica is added"
        " when it appears and answers, drained (no new request, open ones finish) when it"
        " goes (discovery.py)",
    )
    backends_dns_interval_s: float = Field(
        5.0, gt=0, le=300, description="seconds between lookups of backends_dns"
    )
    backends_dns_nameserver: str | None = Field(
        None,
        description="IP[:PORT] of the DNS server to ask for backends_dns; unset: the system's"
        " (/etc/resolv.conf, the cluster's DNS in a pod)",
    )
    tokenizers: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description="model id -> tokenizer source: a local HF folder or a store ref NAME[:VERSION]."
        " Adapters use their parent base's tokenizer (the `parent` field of /v1/models); a"
        " model missing here falls back to its `root` when that is a local folder, then to the"
        " store artifact of the same name.",
    )
    serve_config: Path | None = Field(
        None,
        description="the inference serve config (YAML) the backends run: its served model name"
        " takes its tokenizer from the store artifact `model` (a `tokenizers` entry wins)",
    )
    # timeouts, seconds
    connect_timeout_s: float = Field(5.0, gt=0)
    first_byte_timeout_s: float = Field(
        300.0, gt=0, description="until the upstream's first body byte (a CPU prefill is slow)"
    )
    idle_timeout_s: float = Field(60.0, gt=0, description="longest gap between two body chunks")
    # request limits
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="bytes per request body")
    max_json_depth: int = Field(
        64, ge=4, le=512, description="nesting of arrays/objects in a request body"
    )
    max_messages: int = Field(512, ge=1, description="messages per chat request")
    clamp_max_tokens: bool = Field(
        False,
        description="lower max_tokens to what fits instead of answering 400 (per request:"
        " header `X-Lorastack-Clamp: 1`)",
    )
    # admission control: a backend is saturated when BOTH are at or over their threshold
    admit_max_kv_usage: float = Field(0.95, ge=0, le=1, description="KV-cache usage, 0..1")
    admit_max_waiting: int = Field(8, ge=0, description="requests waiting in vLLM's queue")
    scrape_interval_s: float = Field(2.0, gt=0, description="seconds between /metrics scrapes")
    kv_admit_wait_s: float = Field(
        5.0,
        ge=0,
        description="seconds a request may wait for KV-cache room (its prompt + max_tokens"
        " beside what the gateway has open on the backend) before it is answered 429",
    )
    kv_request_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="the most of a backend's KV cache (0..1) one request of several sequences"
        " (n > 1, a batch of prompts) may claim: n x (prompt + max_tokens) over this share of"
        " every backend serving the model is a 400 naming both numbers, since admitted alone"
        " it would leave no room to anyone else while it runs. A one-sequence request is"
        " held to max_model_len instead",
    )
    backend_max_num_seqs: Annotated[dict[str, int], NoDecode] = Field(
        default_factory=dict,
        description="backend URL -> the requests it runs at once (vLLM's --max-num-seqs, which"
        " its /metrics does not report): JSON or url=N,url=N. Routing sends a request to a"
        " backend with a free slot before one where it would wait. Unset: `serve_config`'s"
        " max_num_seqs for every backend, else routing knows only the queues",
    )
    affinity_table_size: int = Field(
        50_000,
        ge=1,
        description="rows in each of the session and prompt-prefix tables (least recently"
        " used dropped first); a request writes one session row and up to 64 prefix rows",
    )
    prefix_weight: float = Field(
        2.0, ge=0, description="routing weight of prefix-cache affinity; 0 turns it off"
    )
    session_weight: float = Field(
        4.0, ge=0, description="routing weight of session stickiness; 0 turns it off"
    )
    backend_weights: Annotated[dict[str, float], NoDecode] = Field(
        default_factory=dict,
        description="backend URL -> its static routing weight (> 0; unlisted: 1): JSON or"
        " url=W,url=W. Replicas on unlike GPUs (an H100 beside L4s) are preferred by their"
        " weight over the largest, beside the load scorers (static_weight)",
    )
    static_weight: float = Field(
        1.0, ge=0, description="routing weight of backend_weights; 0 turns it off"
    )
    declared_refresh_s: float = Field(
        5.0,
        ge=0,
        description="seconds between reads of the adapters deployments declare in the store: a"
        " request naming one that no backend lists yet is answered 503 with Retry-After (the"
        " replicas are loading it) instead of 404; 0 = off",
    )
    # retries before the first byte only (connection errors, 502, 503)
    retry_attempts: int = Field(3, ge=1, le=10, description="tries in all, first one included")
    retry_backoff_s: float = Field(0.05, ge=0, description="first backoff; doubles, jittered")
    retry_backoff_max_s: float = Field(1.0, ge=0)
    vllm_api_key: SecretStr | None = Field(
        None,
        description="vLLM's --api-key (inference's LORASTACK_VLLM_API_KEY): sent as"
        " `Authorization: Bearer KEY` on every request to a backend; at least 32 characters,"
        " no placeholder (inference's bar); unset: none is sent",
    )
    # auth
    auth_enabled: bool | None = Field(
        None,
        description="require `Authorization: Bearer KEY`; unset: on exactly when keys are"
        " configured (api_keys, api_keys_file or keys_file); false with keys is a start error",
    )
    gateway_allow_unauthenticated: bool = Field(
        False,
        description="allow a bind to a non-loopback host with auth off (an open gateway);"
        " without it that is a start error",
    )
    admin_key: SecretStr | None = Field(
        None,
        description="Bearer key of the operator views (/ready's details); at least 32"
        " characters, no placeholder; unset = those views are off",
    )
    metrics_key: SecretStr | None = Field(
        None,
        description="Bearer key of GET /metrics (Prometheus: `authorization: {type: Bearer,"
        " credentials_file: FILE}`); at least 32 characters, no placeholder. Unset: /metrics"
        " is open while auth is off and refused while it is on (it names every key and"
        " backend)",
    )
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="KEY or ALIAS=KEY entries, each KEY at least 32 characters; ALIAS (letters,"
        " digits, '.', '_', '-') names the key in /metrics and errors, else it is key-N by its"
        " place in the list",
    )
    api_keys_file: Path | None = Field(
        None, description="one KEY or ALIAS=KEY a line, as api_keys; # comments"
    )
    keys_file: Path | None = Field(
        None,
        description="YAML/JSON keys file: named keys (sha256 at rest) with their models,"
        " limits and token budget (`lorastack gateway keys add`); re-read when it changes",
    )
    key_requests_per_min: int = Field(0, ge=0, description="per key; 0 = unlimited")
    key_tokens_per_min: int = Field(
        0, ge=0, description="per key, prompt + max_tokens (refunded to usage); 0 = unlimited"
    )
    redis_url: SecretStr | None = Field(
        None,
        description="redis://[:PASSWORD@]HOST:PORT[/DB] (rediss:// for TLS, unix:///path.sock):"
        " per-key limits and budgets held there, shared by every gateway replica that names"
        " it; unset = each process counts its own. Unreachable: each replica falls back to its"
        " own limits (logged; lorastack_gateway_redis_up 0) until it answers again",
    )
    workers: int = Field(
        1,
        ge=1,
        le=64,
        description="worker processes serving the port (`lorastack gateway --workers N`), one"
        " core each: the KV claims and the admission line are shared between them exactly"
        " (`shared_claims.py`); with N > 1, per-key limits and budgets need redis_url",
    )
    shutdown_grace_s: int = Field(
        10,
        ge=0,
        le=3600,
        description="seconds the open streams get to finish after SIGTERM (no new connection"
        " is taken meanwhile) before they are cut; Kubernetes: keep the pod's"
        " terminationGracePeriodSeconds above it plus its preStop",
    )
    redis_timeout_s: float = Field(
        0.25, gt=0, le=10, description="connect and reply timeout of one Redis call (seconds)"
    )

    @field_validator("backends", "api_keys", mode="before")
    @classmethod
    def _lists(cls, v: Any) -> Any:
        return split_list(v)

    @field_validator("backends")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        out = []
        for url in v:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"backend {url!r} must start with http:// or https://")
            out.append(base_url(url))
        if len(set(out)) != len(out):
            raise ValueError(f"backends repeat a URL: {out}")
        return out

    @field_validator("tokenizers", mode="before")
    @classmethod
    def _map(cls, v: Any) -> Any:
        return split_map(v, "tokenizers must be JSON or model=source,model=source")

    @field_validator("backend_max_num_seqs", mode="before")
    @classmethod
    def _slots(cls, v: Any) -> Any:
        # a URL may hold "=" (a query): the value follows the last one
        return split_map(v, "backend_max_num_seqs must be JSON or url=N,url=N", last=True)

    @field_validator("backend_weights", mode="before")
    @classmethod
    def _backend_weights(cls, v: Any) -> Any:
        return split_map(v, "backend_weights must be JSON or url=W,url=W", last=True)

    @field_validator("backends_dns")
    @classmethod
    def _dns_target(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            return None
        if v is not None:
            dns_target(v)  # raises ValueError naming the form
        return v

    @field_validator("backends_dns_nameserver")
    @classmethod
    def _nameserver(cls, v: str | None) -> str | None:
        if v is not None and v.strip():
            nameserver(v)
            return v.strip()
        return None

    @model_validator(mode="after")
    def _static_or_dns(self) -> GatewaySettings:
        if self.backends_dns is None:
            return self
        if "backends" in self.model_fields_set:
            raise ValueError(
                "backends and backends_dns are both set: use backends_dns (replicas found by"
                " DNS) or backends (a fixed list), not both"
            )
        if self.backend_max_num_seqs:
            raise ValueError(
                "backend_max_num_seqs names URLs, which backends_dns does not know in advance:"
                " set serve_config (its max_num_seqs holds for every replica) instead"
            )
        if self.backend_weights:
            raise ValueError(
                "backend_weights names URLs, which backends_dns does not know in advance:"
                " set backends (a fixed list) to weigh replicas"
            )
        self.backends = []  # found at run time
        return self

    @model_validator(mode="after")
    def _weights_of_backends(self) -> GatewaySettings:
        weights = {base_url(u): w for u, w in self.backend_weights.items()}
        unknown = sorted(set(weights) - set(self.backends))
        if unknown:
            raise ValueError(f"backend_weights names URLs that are not backends: {unknown}")
        if any(w <= 0 for w in weights.values()):
            raise ValueError(f"backend_weights values must be > 0: {weights}")
        self.backend_weights = weights
        return self

    @model_validator(mode="after")
    def _slots_of_backends(self) -> GatewaySettings:
        slots = {base_url(u): n for u, n in self.backend_max_num_seqs.items()}
        unknown = sorted(set(slots) - set(self.backends))
        if unknown:
            raise ValueError(f"backend_max_num_seqs names URLs that are not backends: {unknown}")
        if any(n < 1 for n in slots.values()):
            raise ValueError(f"backend_max_num_seqs values must be >= 1: {slots}")
        if self.serve_config is not None:
            default = served_max_num_seqs(self.serve_config)
            slots = {url: slots.get(url, default) for url in self.backends}
        self.backend_max_num_seqs = slots
        return self

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: SecretStr | None) -> SecretStr | None:
        if v is None or not v.get_secret_value().strip():
            return None
        scheme = v.get_secret_value().partition("://")[0]
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(
                f"redis_url must start with redis://, rediss:// or unix:// (got {scheme!r}:"
                " e.g. redis://127.0.0.1:6379/0)"
            )
        # an example's password left in place is one every reader of the example knows
        password = urlsplit(v.get_secret_value()).password
        if password is not None and (why := secret_problem(password, "redis_url's password")):
            raise ValueError(why)
        return v

    @model_validator(mode="after")
    def _limits_shared(self) -> GatewaySettings:
        limited = self.keys_file or self.key_requests_per_min or self.key_tokens_per_min
        if self.workers > 1 and limited and self.redis_url is None:
            raise ValueError(
                f"workers {self.workers} with per-key limits (keys_file, key_requests_per_min"
                " or key_tokens_per_min) needs redis_url: each worker would count its own,"
                " letting a key through up to N times its limit; set LORASTACK_REDIS_URL, or"
                " run one worker"
            )
        return self

    @model_validator(mode="after")
    def _keys_when_auth(self) -> GatewaySettings:
        if self.api_keys_file is not None and not self.api_keys_file.is_file():
            raise ValueError(f"api_keys_file {self.api_keys_file} does not exist")
        if self.keys_file is not None and not self.keys_file.is_file():
            raise ValueError(
                f"keys_file {self.keys_file} does not exist (`lorastack gateway keys add` makes it)"
            )
        has_keys = bool(self.api_keys or self.api_keys_file or self.keys_file)
        if self.auth_enabled and not has_keys:
            raise ValueError("auth_enabled needs api_keys, api_keys_file or keys_file")
        if self.auth_enabled is False and has_keys:
            raise ValueError(
                "auth_enabled is false but API keys are configured (they would be ignored):"
                " unset LORASTACK_AUTH_ENABLED or set it to true, or remove the keys"
            )
        aliases = [split_alias(k.get_secret_value())[0] for k in self.api_keys]
        for n, key in enumerate(self.api_keys, 1):
            secret = split_alias(key.get_secret_value())[1]
            if why := secret_problem(secret, f"api_keys[{n}]", API_KEY_MIN_CHARS):
                raise ValueError(why)
        named = [a for a in aliases if a]
        if len(set(named)) != len(named):
            raise ValueError(f"api_keys repeat an alias: {sorted(named)}; give each its own")
        for name in ("admin_key", "metrics_key", "vllm_api_key"):  # inference's bar for its copy
            value: SecretStr | None = getattr(self, name)
            if value is not None and (
                why := secret_problem(value.get_secret_value(), name, ADMIN_KEY_MIN_CHARS)
            ):
                raise ValueError(why)
        open_bind = not self.auth_required and not is_loopback(self.host)
        if open_bind and not self.gateway_allow_unauthenticated:
            raise ValueError(
                f"host {self.host} is reachable from other machines and auth is off:"
                " configure API keys (LORASTACK_API_KEYS or LORASTACK_KEYS_FILE), bind"
                " 127.0.0.1, or set LORASTACK_GATEWAY_ALLOW_UNAUTHENTICATED=true to run"
                " an open gateway on purpose"
            )
        if self.serve_config is not None:
            self.tokenizers = served_tokenizers(self.serve_config) | self.tokenizers
        return self

    @property
    def auth_required(self) -> bool:
        """Auth on: set explicitly, or (unset) exactly when keys are configured."""
        if self.auth_enabled is not None:
            return self.auth_enabled
        return bool(self.api_keys or self.api_keys_file or self.keys_file)
