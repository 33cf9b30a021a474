"""The run config: a YAML file parsed into `RunConfig`, plus `key=value` overrides.

Owns the schema (limits live in the fields), dotted-path overrides (`lora.r=16`),
turning validation errors into one ConfigError that names each field and what to
change, and the config hash the resume check compares. Nothing here loads a model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import to_jsonable_python

from lorastack.errors import ConfigError, field_errors
from lorastack.manifest import parse_ref, validate_name
from lorastack.settings import read_yaml_mapping

# Fields that may differ between a checkpoint and the run that resumes it: they change
# when the run stops or how often it reports, never the numbers of the steps it takes.
SAFE_TO_CHANGE = frozenset(
    {
        "max_steps",
        "epochs",
        "checkpoint_every",
        "eval_every",
        "log_every",
        "keep_checkpoints",
        "price_per_gpu_hour",
        "currency",
        "select",
        "early_stopping",
        "max_cost",
        "max_hours",
        "setup_hours",
        "seconds_per_step",
        "on_complete",
        "on_failure",
        "parity_probes",
    }
)

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DatasetConfig(_Strict):
    """Where the chat data comes from: a local JSONL file or a dataset artifact in the store."""

    path: Path | None = Field(None, description="local chat JSONL file (relative to the CWD)")
    ref: str | None = Field(None, description="or a dataset artifact NAME[:VERSION] in the store")
    file: str | None = Field(None, description="which .jsonl inside `ref` (default: the only one)")
    drop_overlong: bool = Field(
        False, description="drop (and count) samples longer than max_seq_len instead of refusing"
    )

    @model_validator(mode="after")
    def _one_source(self) -> DatasetConfig:
        if (self.path is None) == (self.ref is None):
            raise ValueError("give exactly one of dataset.path (a JSONL file) or dataset.ref")
        if self.ref is not None:
            parse_ref(self.ref)
        return self


class SplitConfig(_Strict):
    """How the data is split into train, validation and the frozen test split."""

    validation: float = Field(0.1, ge=0.0, lt=1.0, description="fraction for validation")
    test: float = Field(0.1, ge=0.0, lt=1.0, description="fraction for the frozen test split")
    seed: int = Field(0, ge=0, description="the split's shuffle seed")

    @model_validator(mode="after")
    def _leaves_train(self) -> SplitConfig:
        if self.validation + self.test >= 0.9:
            raise ValueError("split.validation + split.test must leave at least 10% for training")
        return self


class LoraConfig(_Strict):
    """The adapter's shape: rank, scale, dropout and the modules it adapts."""

    r: int = Field(8, ge=1, le=512, description="adapter rank")
    alpha: int = Field(16, ge=1, description="scale = alpha / r; usually 2*r")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="dropout on the adapter input")
    target_modules: list[str] = Field(
        default_factory=lambda: list(ALL_LINEAR), min_length=1, description="module names"
    )


class EarlyStoppingConfig(_Strict):
    """When evaluations that stop improving end the run."""

    patience: int = Field(
        3, ge=1, description="evaluations in a row without improvement before stopping"
    )
    min_delta: float = Field(
        0.0, ge=0.0, description="nats: a smaller fall of the validation loss is no improvement"
    )


class HookConfig(_Strict):
    """A shell command run after a run succeeds or fails (on_success / on_failure)."""

    command: str = Field(
        min_length=1,
        description="shell command (sh -c) run on this host; its environment names the run, "
        "the artifact refs and the cost (LORASTACK_RUN, LORASTACK_ADAPTER_REF, LORASTACK_COST, ...)",
    )
    timeout_s: float = Field(300.0, gt=0, le=86400, description="seconds before it is killed")
    allow_local_store: bool = Field(
        False,
        description="run it even when the store is a file:// folder on this host (e.g. a network "
        "mount that outlives the host); by default such a hook is refused",
    )


class RunConfig(_Strict):
    """One training run's YAML config, validated before anything starts (trainer.config)."""

    base_model: str = Field("smollm2-135m-instruct", description="base-model artifact ref")
    output: str = Field("run", description="artifact prefix: <output>/adapter, /data, ...")
    dataset: DatasetConfig
    split: SplitConfig = Field(default_factory=SplitConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    quantization: Literal["none", "nf4"] = Field("none", description="nf4 = QLoRA")
    max_seq_len: int = Field(512, ge=16, le=131072, description="tokens per sample, in all")
    packing: bool = Field(
        False,
        description="pack several samples into each row of max_seq_len tokens (no attention "
        "across samples; trainer.data.packing); micro_batch then counts rows, not samples",
    )
    micro_batch: int = Field(4, ge=1, le=4096, description="rows (samples) per forward pass")
    grad_accum: int = Field(1, ge=1, le=4096, description="micro-batches per optimizer step")
    lr: float = Field(2e-4, gt=0.0, le=1.0, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    max_grad_norm: float = Field(1.0, gt=0.0, description="gradient clipping (L2 norm)")
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up")
    epochs: int = Field(1, ge=1, le=10000)
    max_steps: int | None = Field(None, ge=1, description="stop after this many steps")
    seed: int = Field(0, ge=0, description="LoRA init, dropout and batch order")
    loss_on: Literal["all_assistant", "last_assistant"] = "all_assistant"
    chat_template: str | None = Field(
        None,
        description="what renders the chats: unset = the base model's own template; "
        "'chatml-tools' = ChatML with Hermes-style tool calls, shipped with the trainer (for "
        "tool-calling data when the model's template has no tool support); or a .jinja file. "
        "The adapter carries it, so serving renders the same way (trainer.data.chat_templates)",
    )
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto",
        description="recompute decoder layers' activations in backward instead of keeping "
        "them: true = every layer (least memory), false = none (fastest); auto = on CUDA as "
        "few layers as the memory estimate needs to fit the GPU's free memory, none on the "
        "CPU (trainer.model.memory.plan_checkpointing)",
    )
    compile: bool | Literal["auto"] = Field(
        "auto",
        description="torch.compile the decoder for training; auto = on CUDA with a C "
        "compiler (Triton needs one), when the first eager steps' time says the compile pays "
        "back over the steps left (trainer.model.compiling.choose_compile)",
    )
    compile_scope: Literal["auto", "layers", "decoder"] = Field(
        "auto",
        description="what one compiled graph holds: one decoder layer (seconds to compile) "
        "or the whole decoder (faster steps, minutes to compile); auto = the one that saves "
        "the most time in this run (compile=true: layers); trainer.model.compiling.compile_decoder",
    )
    fused_lora: bool = Field(
        True,
        description="one autograd node per LoRA linear (trainer.model.fast_lora); false = peft's",
    )
    distributed: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="under torchrun with several processes: ddp = every GPU holds the whole "
        "model (fastest while it fits); fsdp = each decoder layer's weights sharded over the "
        "processes (FSDP2 fully_shard) for a model that does not fit one GPU (trainer.model.sharding); "
        "one process trains unsharded either way",
    )
    select: Literal["best_val_loss", "last"] = Field(
        "best_val_loss",
        description="which adapter is published: the evaluation with the lowest validation "
        "loss (its checkpoint is kept whatever keep_checkpoints says), or the last step",
    )
    parity_probes: int = Field(
        8,
        ge=0,
        le=64,
        description="held-out prompts whose greedy answers and log-probabilities the published "
        "adapter carries (parity-reference.json), so a deployment can check it serves what was "
        "trained (lorastack.parity); 0 = record none",
    )
    early_stopping: EarlyStoppingConfig | None = Field(
        None, description="stop when the validation loss stops improving (needs validation)"
    )
    checkpoint_every: int = Field(50, ge=1, description="optimizer steps between checkpoints")
    eval_every: int = Field(50, ge=1, description="optimizer steps between validation passes")
    log_every: int = Field(1, ge=1, description="optimizer steps between metrics files")
    report_to: list[Literal["tensorboard"]] = Field(
        default_factory=list,
        description="also write the logged series as TensorBoard event files in "
        "RUN_DIR/tensorboard ('tensorboard', or a list; 'none' = nothing)",
    )
    keep_checkpoints: int = Field(2, ge=1, le=1000, description="checkpoint versions kept")
    price_per_gpu_hour: float = Field(0.0, ge=0.0, description="currency units per GPU-hour")
    currency: str = Field("USD", pattern=r"^[A-Z]{3}$", description="of the prices and caps")
    max_cost: float | None = Field(
        None,
        gt=0.0,
        description="cost cap in currency units (needs price_per_gpu_hour): refused at preflight "
        "when the estimate exceeds it; stops at a published checkpoint when reached",
    )
    max_hours: float | None = Field(
        None, gt=0.0, description="wall-clock cap in hours, all sessions of the run together"
    )
    setup_hours: float = Field(
        0.25, ge=0.0, description="set-up allowance the preflight estimate adds (hours)"
    )
    seconds_per_step: float | None = Field(
        None,
        gt=0.0,
        description="measured seconds per optimizer step for the preflight estimate (e.g. from "
        "'lorastack cost estimate'); default: this output's --smoke run",
    )
    on_complete: HookConfig | None = Field(
        None, description="run after the adapter, records and last checkpoint are verified off-host"
    )
    on_failure: HookConfig | None = Field(
        None, description="run after a failed run's support memo is verified off-host"
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        if isinstance(v, str):  # report_to: tensorboard, as HF's TrainingArguments take it
            return [] if v == "none" else [v]
        return v

    @model_validator(mode="after")
    def _names(self) -> RunConfig:
        try:
            parse_ref(self.base_model)
            validate_name(self.output, "output name")
        except ConfigError as e:
            raise ValueError(f"{e.message}; {e.hint}") from None
        # the run publishes its own split there: after the first run the artifact holds
        # the split's files, and a restart (--resume auto) cannot tell which to read
        if self.dataset.ref is not None and parse_ref(self.dataset.ref)[0] == f"{self.output}/data":
            raise ValueError(
                f"dataset.ref {self.dataset.ref!r} is where this run publishes its own split"
                f" ({self.output}/data); publish your file as a dataset of its own"
                " (`lorastack data publish FILE --name NAME`) and set dataset.ref: NAME"
            )
        unknown = [m for m in self.lora.target_modules if not m.replace("_", "").isalnum()]
        if unknown:
            raise ValueError(f"lora.target_modules holds invalid module names {unknown}")
        if self.max_cost is not None and self.price_per_gpu_hour == 0:
            raise ValueError(
                "max_cost needs price_per_gpu_hour (the cost of a run is GPU-hours x that price)"
            )
        if self.distributed == "fsdp" and self.quantization != "none":
            raise ValueError(
                f"quantization: {self.quantization} (QLoRA) is not supported with distributed: "
                "fsdp: bitsandbytes shards 4-bit weights only with bnb_4bit_quant_storage set "
                "to the compute dtype, a path not tested here; set quantization: none (LoRA on "
                "a bf16 base, sharded) or distributed: ddp (QLoRA, the whole model on each GPU)"
            )
        if self.distributed == "fsdp" and self.compile is True:
            raise ValueError(
                "compile: true is not supported with distributed: fsdp (the compiled decoder "
                "is not tested with sharded layers); set compile: auto (FSDP runs eager) or false"
            )
        return self

    def config_hash(self) -> str:
        """sha256 of the config without the fields that are safe to change on resume."""
        data = self.model_dump(mode="json")
        for key in SAFE_TO_CHANGE:
            data.pop(key, None)
        if data.get("chat_template") is None:  # the hash of runs from before the field
            data.pop("chat_template", None)
        if data.get("distributed") == "ddp":  # likewise
            data.pop("distributed", None)
        return "sha256:" + hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def check_processes(config: RunConfig, world_size: int) -> None:
    """Refuse a run config whose optimizer step cannot split over `world_size` processes:
    each takes grad_accum / world_size micro-batches of every step.

    Raises:
        ConfigError: grad_accum is not a multiple of world_size.
    """
    if config.grad_accum % world_size:
        raise ConfigError(
            f"grad_accum={config.grad_accum} does not split over {world_size} processes: each "
            "takes grad_accum / world_size micro-batches of every optimizer step",
            f"set grad_accum to a multiple of {world_size} (the global batch is micro_batch x "
            "grad_accum, whatever the number of processes)",
        )


def is_default(path: str, value: Any) -> bool:
    """Whether `value` (its JSON form, as a run manifest keeps it) is the default of the
    dotted config field `path` (`report_to`, `lora.dropout`). A field added since an
    older run manifest was written, left at its default, changes nothing that run did."""
    model: type[BaseModel] = RunConfig
    *sections, leaf = path.split(".")
    for name in sections:
        section = model.model_fields.get(name)
        if section is None:
            return False
        kinds = (section.annotation, *get_args(section.annotation))  # X, or X | None
        models = [t for t in kinds if isinstance(t, type) and issubclass(t, BaseModel)]
        if not models:
            return False
        model = models[0]
    field = model.model_fields.get(leaf)
    if field is None or field.is_required():
        return False
    default = field.get_default(call_default_factory=True)
    return bool(to_jsonable_python(default) == value)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["lora.r=16", "lr=1e-4"]` -> nested dict; values are parsed as YAML scalars/lists."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not seg for seg in key.split(".")):
            raise ConfigError(
                f"override {item!r} is not key=value", "write e.g. lora.r=16 or lr=1e-4"
            )
        value = yaml.safe_load(raw) if raw else ""
        node = out
        *parents, last = key.split(".")
        for seg in parents:
            node = node.setdefault(seg, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with another override", "")
        node[last] = value
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = _merge(merged[k], v)
        else:
            merged[k] = v
    return merged


def _field_hint(loc: tuple[int | str, ...]) -> str:
    model: Any = RunConfig
    field = None
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return ""
        field = fields[part]
        model = field.annotation
    return (field.description or "") if field is not None else ""


def build_config(data: dict[str, Any], source: str = "config") -> RunConfig:
    """Validate a dict; every problem is named by its dotted field path."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        lines = []
        for (where, msg), err in zip(field_errors(e, "(top level)"), e.errors(), strict=True):
            if err["type"] == "extra_forbidden":
                msg = "unknown field"
            elif "input" in err and not isinstance(err["input"], dict):
                msg += f" (got {err['input']!r})"
            hint = _field_hint(tuple(err["loc"]))
            lines.append(f"  {where}: {msg}" + (f"  [{hint}]" if hint else ""))
        fields = ", ".join(sorted(RunConfig.model_fields))
        raise ConfigError(
            f"{source} is invalid:\n" + "\n".join(lines),
            f"fix the field(s) above in the YAML file or with key=value; top-level fields: {fields}",
        ) from None


def load_config(path: Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML run config, apply `key=value` overrides, validate."""
    data = read_yaml_mapping(path, "config file", "see trainer/configs/demo.yaml")
    return build_config(_merge(data, parse_overrides(overrides or [])), str(path))


def with_overrides(config: RunConfig, items: list[str]) -> RunConfig:
    """The config with `key=value` overrides applied, validated again."""
    return build_config(_merge(config.model_dump(mode="json"), parse_overrides(items)))
