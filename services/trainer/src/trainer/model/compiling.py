"""torch.compile for training: whether to compile, what, into which cache, and what it cost.

Owns the `compile` / `compile_scope` settings' meaning (use_compile, compile_decoder),
the decision of `compile: auto` by expected benefit (choose_compile), the on-disk compile
cache that lets a resumed or repeated run skip most of the compile (use_cache_dir; a
first run fills it from a child process meanwhile: trainer.compile_ahead), the
shapes the compiler sees (mark_dynamic_width; trainer.data.batching keeps them few), and the
compile report (compile_report). It never loads a model (trainer.model.modeling does).

Why one compile per run matters: each micro-batch padded to its own width gave three
compiles of minutes each (a static graph, a dynamic one after the first size guard
failed, a third after inductor's alignment guard), and transformers' embedding
hook broke the decoder's graph in two. Packed rows have one shape; unpacked batches get
widths rounded to a multiple of 64 and a width marked dynamic before the first call.
"""

from __future__ import annotations

import copyreg
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from lorastack.errors import ConfigError
from trainer.config import RunConfig

if TYPE_CHECKING:
    from trainer.model.ahead import Ahead

# AOT autograd's activation_memory_budget for the whole-decoder graph: at its default
# (1.0) the partitioner saves each checkpointed layer's matmul outputs (gate, up, q/o- and
# k/v-sized) rather than recompute them; 0.5 keeps less at nearly the same speed
# (bench/trainer/trainer_gpu_saved.py; the figures in bench/trainer/README.md)
DECODER_ACTIVATION_BUDGET = 0.5

# choose_compile's model, fitted to GPU measurements (bench/trainer/README.md, "Where
# the code's constants come from"): a cold compile of the whole decoder costs a base plus
# a time per layer, one layer's graph a fixed time; a warm on-disk cache skips inductor
# and Triton, leaving dynamo's trace and the cache lookups (WARM_FRACTION of a cold
# compile). COMPILED_STEP_FRACTION: a compiled step's time over an eager one's, the
# cautious end of what was measured.
COMPILE_BASE_S = 10.0
COMPILE_PER_LAYER_S = 5.0
COMPILE_LAYER_GRAPH_S = 15.0
WARM_FRACTION = 0.3
COMPILED_STEP_FRACTION = {"layers": 0.68, "decoder": 0.55}
EAGER_PROBE_STEPS = 2  # auto measures this many eager steps (the first warms up) first


def use_compile(config: RunConfig, device: torch.device) -> bool:
    """Whether the run may compile its decoder (config `compile`: true, false, auto).

    true compiles from the first step; auto only on CUDA (off on the CPU: a long compile
    for little gain), and then only where choose_compile says it pays. Both need a
    compiler (Triton builds its launcher with a C compiler; inductor's CPU code is C++):
    auto without one stays eager, true without one is a ConfigError. Under distributed: fsdp
    auto stays eager (true is refused by the config: compiled sharded layers are untested)."""
    choice = config.compile
    auto_off = device.type != "cuda" or config.distributed == "fsdp"
    if choice is False or (choice == "auto" and auto_off):
        return False
    env, *names = ("CC", "gcc", "clang") if device.type == "cuda" else ("CXX", "g++", "clang++")
    found = any(shutil.which(n) for n in (os.environ.get(env), *names) if n)
    if not found and choice is True:
        raise ConfigError(
            f"compile=true on {device.type} needs a compiler ({' or '.join(names)}, or "
            f"${env}) and none is on PATH",
            f"install {names[0]}, or set compile=false",
        )
    return found


def compile_seconds(layers: int, scope: str, warm: bool) -> float:
    """Expected seconds to compile (see the constants above)."""
    cold = COMPILE_BASE_S + COMPILE_PER_LAYER_S * layers
    cold = cold if scope == "decoder" else COMPILE_LAYER_GRAPH_S
    return cold * (WARM_FRACTION if warm else 1.0)


def choose_compile(
    eager_step_s: float, steps_left: int, layers: int, scopes: list[str], warm: dict[str, bool]
) -> tuple[str | None, str]:
    """The scope among `scopes` whose compile saves the most time net of its cost (None:
    stay eager, when none saves more than it costs), and a line that says why."""
    net, facts = {}, []
    for scope in scopes:
        cost = compile_seconds(layers, scope, warm[scope])
        saved = steps_left * eager_step_s * (1 - COMPILED_STEP_FRACTION[scope])
        net[scope] = saved - cost
        cache = "warm cache" if warm[scope] else "cold cache"
        facts.append(f"{scope}: ~{saved:.0f} s saved for ~{cost:.0f} s of compile ({cache})")
    best = max(net, key=net.__getitem__)
    why = f"{steps_left} steps left x {eager_step_s:.2f} s eager; " + "; ".join(facts)
    if net[best] <= 0:
        return None, f"compile auto: staying eager ({why}; compile=true forces it)"
    return best, f"compile auto: compiling {best} ({why})"


def compile_decoder(model: Any, scope: str, dynamic_width: bool = False) -> None:
    """torch.compile the decoder for training (evaluation and generation, with their
    caches and one-token shapes, stay eager).

    scope "decoder": the whole decoder as one graph, checkpointing inside it, compiled
    with AOT autograd's CSE off (with it, the forward's and backward's nf4
    dequantisations merge and stay alive) and an activation budget of
    DECODER_ACTIVATION_BUDGET: the fastest at small batches, at more memory than "layers".
    scope "layers": one graph per decoder layer, shared by all layers, called inside the
    per-layer checkpointing: seconds to compile, the least memory, bound by the host at
    small batches (bench/trainer/README.md has the figures). `dynamic_width`: the
    layers' inputs vary in width (unpacked batches), so the one graph is dynamic."""
    import torch._functorch.config
    import torch._inductor.config

    # dropout through torch's own RNG ops: the eager masks, replayed by checkpointing
    torch._inductor.config.fallback_random = True
    # the LoRA layers' autograd.Functions (trainer.model.fast_lora, bitsandbytes' 4-bit matmul)
    # made AOT autograd bypass its disk cache, so a warm run still traced every graph;
    # their forward and backward are traced into the graph, so its cache key covers them
    torch._functorch.config.autograd_cache_allow_custom_autograd_functions = True
    copyreg.pickle(torch.memory_format, _reduce_memory_format)
    decoder = model.get_base_model().get_decoder()
    modules = [decoder] if scope == "decoder" else list(getattr(decoder, "layers", []))
    if scope == "layers":
        embeddings = model.get_base_model().get_input_embeddings()
        embeddings.register_forward_hook(_first_layer_input_needs_grad)
    for module in modules:
        eager = module.forward
        compiled = torch.compile(eager)

        def forward(
            *args: Any, _m: Any = module, _c: Any = compiled, _e: Any = eager, **kw: Any
        ) -> Any:
            if not _m.training:
                return _e(*args, **kw)
            # the joint graph is partitioned at the forward's compile: settings from there
            if scope != "decoder":
                if dynamic_width:
                    _mark_width_dynamic(args, kw)
                with torch._functorch.config.patch(cse=False):
                    return _c(*args, **kw)
            budget = DECODER_ACTIVATION_BUDGET
            with torch._functorch.config.patch(cse=False, activation_memory_budget=budget):
                return _c(*args, **kw)

        module.forward = forward


def _memory_format(name: str) -> torch.memory_format:
    return cast(torch.memory_format, getattr(torch, name.removeprefix("torch.")))


def _reduce_memory_format(fmt: torch.memory_format) -> tuple[Any, tuple[str]]:
    """Pickle a memory format through a fixed module. The compile caches' keys pickle
    the inputs' metadata, and pickle names a memory format by the first module in
    sys.modules that holds `torch`: the key moved with import order, so a graph another
    kind of process compiled (trainer.compile_ahead, a test) never hit."""
    return _memory_format, (str(fmt),)


def _mark_width_dynamic(args: Any, kw: dict[str, Any]) -> None:
    """A layer's inputs vary in width with unpacked batches (hidden states, rotary
    tables, the mask): mark every dimension of that width dynamic before the first
    call, as mark_dynamic_width does for the batch, or the first graph is static."""
    from torch.utils._pytree import tree_leaves

    first = args[0] if args else kw["hidden_states"]
    width = first.shape[1]
    for t in tree_leaves((args, kw)):
        if isinstance(t, torch.Tensor):
            for dim in range(1, t.dim()):
                if t.shape[dim] == width:
                    torch._dynamo.maybe_mark_dynamic(t, dim)


def _first_layer_input_needs_grad(module: Any, args: Any, output: torch.Tensor) -> None:
    """The embeddings' output asks for its gradient while training, as every later
    layer's input does: otherwise the first layer's call fails the shared graph's
    requires_grad guard and compiles a second pair of graphs (half the compile again);
    the price is three input-gradient matmuls in the first layer."""
    if module.training and torch.is_grad_enabled():
        output.requires_grad_(True)


def mark_dynamic_width(batch: dict[str, torch.Tensor]) -> None:
    """Tell dynamo the width (dim 1) varies before its first call, so the first compile
    is the dynamic one instead of a static graph that the next width throws away."""
    for t in batch.values():
        torch._dynamo.maybe_mark_dynamic(t, 1)


def mark_dynamic_samples(batch: dict[str, torch.Tensor]) -> None:
    """Packed rows hold a different number of samples each micro-batch: their offsets
    (variable-length attention's input, trainer.model.attention) are marked dynamic before the
    first call, or the first graph is static and the second micro-batch compiles again."""
    if "cu_seq_lens" in batch:
        torch._dynamo.maybe_mark_dynamic(batch["cu_seq_lens"], 0)


def use_cache_dir(cache_dir: Path) -> Path:
    """Keep inductor's and Triton's caches (FX graphs, AOT autograd, kernels) in
    `cache_dir`: by default they live in /tmp (torch sets TORCHINDUCTOR_CACHE_DIR there
    itself) and die with a container, so every run compiled from scratch."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    os.environ.setdefault("TRITON_CACHE_DIR", str(cache_dir / "triton"))
    return cache_dir


def graph_key(model_config: dict[str, Any], config: RunConfig, scope: str) -> str:
    """What decides the compiled graphs: the architecture, the adapter, the shapes, torch."""
    keys = ("quantization", "packing", "max_seq_len", "micro_batch", "lora")
    run = config.model_dump(mode="json")
    what = {
        "model": model_config,
        "run": {k: run[k] for k in keys},
        "scope": scope,
        "torch": torch.__version__,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def is_warm(cache_dir: Path, key: str) -> bool:
    """Whether the compile cache already holds the graphs of `key`."""
    return (cache_dir / "lorastack-graphs" / key).exists()


def mark_warm(cache_dir: Path, key: str) -> None:
    """Record that the compile cache holds the graphs of `key`."""
    folder = cache_dir / "lorastack-graphs"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / key).touch()


def compile_report() -> dict[str, Any]:
    """What dynamo and inductor did so far in this process: graphs compiled, graph
    breaks, seconds spent compiling, on-disk cache hits and misses."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    seconds = sum(compilation_time_metrics.get("_compile.compile_inner", []))
    return {
        "graphs": int(counters["stats"].get("unique_graphs", 0)),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "compile_s": round(float(seconds), 1),
        "fx_cache_hits": int(counters["inductor"].get("fxgraph_cache_hit", 0)),
        "fx_cache_misses": int(counters["inductor"].get("fxgraph_cache_miss", 0)),
        "aot_cache_hits": int(counters["aot_autograd"].get("autograd_cache_hit", 0)),
    }


class CompileRun:
    """The compile lifecycle of one run: compiled from the start (compile=true), decided
    after EAGER_PROBE_STEPS measured eager steps (auto), or eager; and, once compiled,
    one line that says what the compile cost and whether the cache served it.

    compile_scope auto: compile=true takes "layers" (seconds to compile); compile=auto
    weighs both scopes (choose_compile), the whole decoder only when every layer is
    checkpointed (its activation budget was measured so)."""

    def __init__(
        self,
        config: RunConfig,
        device: torch.device,
        model_config: dict[str, Any],
        cache: Path,
        ahead: Ahead | None = None,
        all_checkpointed: bool = True,
    ) -> None:
        self.allowed = use_compile(config, device)
        self.ahead = ahead  # the child compiling the layer graph (trainer.compile_ahead)
        self.ahead_said = ""
        self.deferred: str | None = None  # the scope to compile once the child is done
        self.packed = config.packing  # packed rows have one width: a static graph
        scope = config.compile_scope
        auto = ["layers", "decoder"] if all_checkpointed else ["layers"]
        self.scopes: list[str] = auto if scope == "auto" else [scope]
        self.layers = int(model_config.get("num_hidden_layers", 0))
        self.pending = self.allowed and config.compile == "auto"
        self.scope: str | None = None  # once compiled
        self.reported = False
        if self.allowed:
            self.cache_dir = use_cache_dir(cache)
            self.keys = {s: graph_key(model_config, config, s) for s in self.scopes}

    @property
    def active(self) -> bool:
        return self.scope is not None

    def begin(self, model: Any) -> str:
        """Compile now if forced; what the start line says of compiling."""
        if self.allowed and not self.pending:  # every step compiled: waits for a child
            self._compile(model, self.scopes[0])
            return f", {self.scope} compiled at the first step"
        if self.pending:
            return f", compile auto decides after {EAGER_PROBE_STEPS} eager steps"
        return ""

    def _ready(self, scope: str) -> bool:
        """False while a child compiles this scope's graph ahead: compile=auto steps on
        eagerly meanwhile (an eager step costs little more than a compiled one; waiting
        costs it all) and compiles from the cache once the child is done."""
        return scope != "layers" or self.ahead is None or self.ahead.finished()

    def _compile(self, model: Any, scope: str) -> None:
        if self.ahead is not None and scope == "layers":
            self.ahead_said = "; " + self.ahead.wait()
        self.stop_ahead()
        if is_warm(self.cache_dir, self.keys[scope]):
            # the graphs come from the disk cache: no pool of compile workers (16 processes
            # importing torch on a 16-core host, beside the steps, and shut down at exit)
            import torch._inductor.config

            torch._inductor.config.compile_threads = 1
        compile_decoder(model, scope, dynamic_width=not self.packed)
        self.scope = scope

    def stop_ahead(self) -> None:
        """Stop the child compiling ahead, if there is one."""
        if self.ahead is not None:
            self.ahead.stop()
            self.ahead = None

    def after_step(
        self, model: Any, session_steps: int, step_s: float, steps_left: int, agree: Any = None
    ) -> str | None:
        """Called after each optimizer step; returns a line to print, if any. `agree`
        turns this process's choice into the run's (rank 0's, under DDP)."""
        if self.deferred is not None:
            if self._ready(self.deferred):
                self._compile(model, self.deferred)
                self.deferred = None
            return None
        if self.scope is not None and not self.reported:
            self.reported = True
            mark_warm(self.cache_dir, self.keys[self.scope])
            r = compile_report()
            return (
                f"compiled {self.scope}: first compiled step {step_s:.1f} s, "
                f"{r['compile_s']:.0f} s in dynamo; {r['graphs']} graph(s), "
                f"{r['graph_breaks']} graph break(s); disk cache {r['fx_cache_hits']} hit(s), "
                f"{r['fx_cache_misses']} miss(es) ({self.cache_dir}){self.ahead_said}"
            )
        if not self.pending or session_steps < EAGER_PROBE_STEPS:
            return None
        self.pending = False
        warm = {s: is_warm(self.cache_dir, k) for s, k in self.keys.items()}
        warm["layers"] = warm.get("layers", False) or self.ahead is not None
        scope, line = choose_compile(step_s, steps_left, self.layers, self.scopes, warm)
        if agree is not None:
            scope = agree(scope)
        if scope is not None and not self._ready(scope):
            self.deferred = scope
            return line + "; eager until the child compiling ahead is done"
        if scope is not None:
            self._compile(model, scope)
        self.stop_ahead()
        return line
