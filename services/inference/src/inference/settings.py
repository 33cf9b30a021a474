"""The inference service's one settings class, and loading it from a serve YAML file.

Every field can come from the YAML file given to `lorastack serve CONFIG` or from the
environment (`LORASTACK_<FIELD>`); the file wins. Unknown keys in the file are refused
so a typo does not silently fall back to a default.

    # serve.yaml
    model: smollm2-135m-instruct          # store ref NAME[:VERSION]: base or merged model
    served_model_name: smollm2            # name clients send as "model"
    adapters: [demo/adapter:3, demo/adapter@promoted]  # demo/adapter-v3 and demo/adapter-promoted
    label_refresh_s: 30                   # seconds between looks at where @labels point now
    deployment: chat                      # key of its declared adapters; default: served name
    adapter_sync_s: 5                     # seconds between looks at the declared adapters
    max_model_len: 2048                   # tokens, prompt + output, per request
    max_num_seqs: 8                       # requests running at once
    kv_cache_gib: 1                       # CPU only: KV cache space in GiB
    gpu_memory_utilization: 0.9           # GPU only: fraction of the device vLLM may take
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator

from lorastack.errors import ConfigError, field_errors
from lorastack.manifest import parse_ref, served_name, validate_name
from lorastack.secrets import ADMIN_KEY_MIN_CHARS, secret_problem
from lorastack.serving import check_max_lora_rank
from lorastack.settings import CommonSettings, read_yaml_mapping

MIN_KEY_CHARS = 32  # secrets.token_urlsafe(32) gives 43


class InferenceSettings(CommonSettings):
    """The inference service's one settings class: what to serve and how vLLM runs it."""

    model: str = Field("", description="store ref NAME[:VERSION] of a base or merged model")
    served_model_name: str = Field("", description="model name clients use; default: model name")
    adapters: list[str] = Field(
        default_factory=list,
        description="adapter refs to preload: NAME[:VERSION] served as NAME-vVERSION, "
        "NAME@LABEL served as NAME-LABEL and following the label",
    )
    label_refresh_s: float = Field(
        30.0,
        ge=0.0,
        description="seconds between re-resolving NAME@LABEL adapters in the store (a moved "
        "label is loaded in place under NAME-LABEL); 0 = only on POST /admin/labels/refresh",
    )
    deployment: str = Field(
        "",
        description="the name under which the store keeps the adapters this deployment serves"
        " (POST/DELETE /admin/adapters change them; every replica of the same deployment"
        " loads them); default: the served model name",
    )
    adapter_sync_s: float = Field(
        5.0,
        ge=0.0,
        description="seconds between looks at the deployment's declared adapters in the store;"
        " 0 = only when vLLM (re)starts and on POST /admin/adapters/refresh",
    )
    enable_lora: bool = Field(False, description="allow adapters (on when adapters are listed)")
    max_loras: int = Field(2, ge=1, le=64, description="adapters in one batch")
    max_lora_rank: int = Field(16, description="largest adapter rank r accepted")
    max_model_len: int = Field(2048, ge=16, description="tokens, prompt + output, per request")
    max_num_seqs: int = Field(8, ge=1, le=4096, description="requests running at once")
    typical_request_tokens: int = Field(
        0, ge=0, description="tokens a typical request holds, for the preemption warning; "
        "0 = max_model_len"
    )  # fmt: skip
    dtype: str = Field(
        "auto",
        description="weights/compute dtype vLLM runs in: float32 | bfloat16 | float16; auto = "
        "the dtype the served model or its adapters were trained in (their parity reference), "
        "else float32 on CPU and bfloat16 on CUDA",
    )
    parity: Literal["auto", "refuse", "warn", "off"] = Field(
        "auto",
        description="what a served model or adapter whose answers differ from its parity "
        "reference (recorded where it was trained) gets: refuse = not served (the model: not "
        "ready; an adapter: unloaded), warn = served and reported, auto = refuse, except where "
        "either side's base is quantised (an adapter trained on nf4, QLoRA; a base vLLM "
        "quantises, --quantization in extra_vllm_args), whose gap is the quantisation's: warn",
    )
    parity_timeout_s: float = Field(
        300.0,
        gt=0,
        le=3600,
        description="seconds a parity check (every probe of one model or adapter) may take;"
        " past it the check could not run: refused under refuse/auto, served under warn."
        " /ready waits at most this long per model and adapter",
    )
    parity_request_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="seconds one request of a parity check may take"
    )
    kv_cache_dtype: str = Field("auto", description="auto = the compute dtype; fp8 on GPU")
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    gpu_kv_cache_gib: float = Field(
        0.0,
        ge=0.0,
        le=4096,
        description="GPU: a fixed KV cache in GiB (vLLM's --kv-cache-memory-bytes) in place of"
        " gpu_memory_utilization, for a GPU shared with another process (the demo trains beside"
        " vLLM), whose memory vLLM's start-up profile would count as its own; 0 = off",
    )
    gpu_overhead_gib: float = Field(
        2.0, ge=0.0, description="GPU memory besides weights and KV (activations, graphs), GiB"
    )
    gpu_memory_gib: float = Field(0.0, ge=0.0, description="for the estimate; 0 = ask the GPU")
    kv_cache_gib: float = Field(1.0, gt=0.0, le=1024, description="CPU only: KV cache space, GiB")
    engine: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: from installed vLLM")
    host: str = Field("127.0.0.1", description="vLLM's bind address (0.0.0.0 in a container)")
    port: int = Field(8000, ge=1, le=65535, description="vLLM's OpenAI API port")
    supervisor_host: str = "127.0.0.1"
    admin_key: SecretStr | None = Field(
        None,
        description="`Authorization: Bearer KEY` for /admin/*; unset, /admin answers only"
        " when supervisor_host is a loopback address",
    )
    supervisor_port: int = Field(
        8001, ge=1, le=65535, description="/health /ready /status /metrics"
    )
    vllm_api_key: SecretStr | None = Field(
        None,
        description="vLLM's --api-key (given through VLLM_API_KEY, never on its command line):"
        " every /v1/* call, load_lora_adapter included, needs `Authorization: Bearer KEY`;"
        " the gateway sends the same key (its LORASTACK_VLLM_API_KEY). Unset: vLLM's API"
        " is open to whoever reaches its port",
    )
    workdir: Path | None = Field(None, description="vLLM logs, caches, sockets; default HOME/serve")
    startup_timeout_s: float = Field(900.0, gt=0, description="seconds for load + warm-up")
    restart_backoff_s: float = Field(2.0, gt=0, description="first restart delay, seconds")
    restart_backoff_max_s: float = Field(60.0, gt=0, description="cap on the restart delay")
    max_identical_failures: int = Field(
        3,
        ge=1,
        description="starts in a row that die of the same root cause before the supervisor"
        " stops restarting vLLM (state `failed`, the cause on /status)",
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="at shutdown (SIGTERM), seconds to wait for vLLM's running and waiting"
        " requests to end before it is stopped; /ready answers 503 meanwhile. Keep it below"
        " the pod's terminationGracePeriodSeconds less its preStop delay; 0 = stop at once",
    )
    log_tail_lines: int = Field(50, ge=1, le=2000, description="vLLM log lines kept on /status")
    extra_vllm_args: list[str] = Field(default_factory=list, description="passed to vLLM as is")

    @field_validator("model")
    @classmethod
    def _model_ref(cls, v: str) -> str:
        if v:
            parse_ref(v)
        return v

    @field_validator("adapters")
    @classmethod
    def _adapter_refs(cls, v: list[str]) -> list[str]:
        for ref in v:
            parse_ref(ref)
        return v

    @field_validator("deployment")
    @classmethod
    def _deployment(cls, v: str) -> str:
        return validate_name(v, "deployment name") if v else v

    @field_validator("served_model_name")
    @classmethod
    def _served(cls, v: str) -> str:
        return validate_name(v, "served model name") if v else v

    @field_validator("admin_key")
    @classmethod
    def _admin_key(cls, v: SecretStr | None) -> SecretStr | None:
        # an empty key would open /admin: compare_digest(b"", b"") is True
        value = None if v is None else v.get_secret_value()
        if value is not None and (
            problem := secret_problem(value, "admin_key", ADMIN_KEY_MIN_CHARS)
        ):
            raise ValueError(problem)
        return v

    @field_validator("vllm_api_key")
    @classmethod
    def _vllm_key(cls, v: SecretStr | None) -> SecretStr | None:
        # a short or placeholder key is a key an attacker on the network can guess
        if v is not None and (
            problem := secret_problem(v.get_secret_value(), "vllm_api_key", MIN_KEY_CHARS)
        ):
            raise ValueError(problem)
        return v

    @field_validator("max_lora_rank")
    @classmethod
    def _rank(cls, v: int) -> int:
        return check_max_lora_rank(v)

    @model_validator(mode="after")
    def _consistent(self) -> InferenceSettings:
        if self.adapters:
            self.enable_lora = True
        if self.port == self.supervisor_port:
            raise ValueError("port and supervisor_port must differ")
        if self.restart_backoff_max_s < self.restart_backoff_s:
            raise ValueError("restart_backoff_max_s must be >= restart_backoff_s")
        return self

    @property
    def resolved_served_name(self) -> str:
        return served_name(self.model, self.served_model_name)

    @property
    def resolved_deployment(self) -> str:
        return self.deployment or self.resolved_served_name

    @property
    def resolved_workdir(self) -> Path:
        return self.workdir or self.home / "serve"

    @property
    def typical_tokens(self) -> int:
        """Tokens a typical request holds (prompt + output), for the preemption warning."""
        return self.typical_request_tokens or self.max_model_len


def build_settings(**values: Any) -> InferenceSettings:
    """InferenceSettings from keyword values (+ environment), errors as ConfigError."""
    unknown = sorted(set(values) - set(InferenceSettings.model_fields))
    if unknown:
        raise ConfigError(
            f"unknown setting(s): {', '.join(unknown)}",
            f"valid keys: {', '.join(sorted(InferenceSettings.model_fields))}",
        )
    try:
        return InferenceSettings(**values)
    except ValidationError as e:
        problems = "; ".join(f"{where}: {what}" for where, what in field_errors(e, "config"))
        raise ConfigError(f"invalid serve settings: {problems}", "fix these keys") from None


def load_serve_config(path: Path) -> InferenceSettings:
    """Settings from a serve YAML file (keys as in InferenceSettings) plus the environment."""
    data = read_yaml_mapping(path, "serve config", "e.g. 'model: NAME'")
    settings = build_settings(**data)
    if not settings.model:
        raise ConfigError(f"{path} names no model", "add 'model: NAME[:VERSION]' (a store ref)")
    return settings
