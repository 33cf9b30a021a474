"""Exact prompt token counts, computed the way vLLM 0.32 computes them.

Chat (vLLM `renderers/hf.py`): messages are normalised (text parts joined with "\\n" when
the template reads `content` as a string; `developer` becomes `system` when the template
does not know that role), the model's chat template is rendered with
`add_generation_prompt` (default true), `continue_final_message`, `tools` and
`chat_template_kwargs`, and the text is encoded WITHOUT extra special tokens
(`add_special_tokens` defaults to false for chat: the template already wrote them).
Completions: each prompt string is encoded WITH special tokens (vLLM's default true);
token-id prompts count as they are.

`upper_bound` is a count the exact one can never exceed, without encoding: every token
of a BPE (byte-level or byte-fallback), WordPiece or Unigram vocabulary spans at least one
byte of the normalised text, a Metaspace pre-tokenizer adds at most one "▁" token to a
non-empty section, and the post-processor adds a fixed number of special tokens. So
tokens <= 2 x UTF-8 bytes of the normalised text + those special tokens. The proxy uses
it to forward a request that provably fits before its exact count is known.

Owns: loading tokenizers (a local HF folder, or only the tokenizer files of a store
artifact), retrying a failed load after a capped exponential backoff, and counting.
Does not own: which model uses which tokenizer source (`backends.py` decides).
"""

from __future__ import annotations

import gc
import random
import re
import threading
import time
from collections import ChainMap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.errors import BadRequest, TokenizerUnavailable
from gateway.validation import ChatRequest, CompletionRequest
from lorastack.settings import CommonSettings

# a template that loops over a message's content expects OpenAI-style parts (vLLM "openai")
_LOOPS_OVER_CONTENT = re.compile(
    r"for\s+\w+\s+in\s+(?:message|msg|m)(?:\[\s*['\"]content['\"]\s*\]|\.content)"
)


def _flatten_globals(template: str) -> None:
    """Give the compiled chat template (transformers caches it by its text, and
    `apply_chat_template` renders that very object) its globals as one dict instead of
    jinja's ChainMap over the environment's: jinja copies the globals into a new context
    on every render, and a ChainMap copies key by key in Python. That was ~25% of a
    short chat's render, on the path of every request (bench/gateway/history.md). The
    values are the same: transformers sets the environment's globals before it compiles,
    and never after. With another transformers (no such cache), nothing changes."""
    if not template:
        return
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        compiled = _compile_jinja_template(template)
    except Exception:  # no jinja2, another transformers, a template that does not compile
        return  # (apply_chat_template then says what is wrong, as before)
    if isinstance(compiled.globals, ChainMap):
        compiled.globals = dict(compiled.globals)


class CountingTokenizer:
    """One loaded tokenizer and its chat template; thread-safe for counting."""

    def __init__(self, hf_tokenizer: Any, source: str) -> None:
        self.hf = hf_tokenizer
        self.source = source
        self.fast = hf_tokenizer.backend_tokenizer  # the Rust tokenizer: encode without overhead
        template = hf_tokenizer.chat_template or ""
        for one in template.values() if isinstance(template, dict) else [template]:
            _flatten_globals(one)
        self.openai_content = bool(_LOOPS_OVER_CONTENT.search(template))
        self.knows_developer = "developer" in template
        self.has_template = bool(template)
        processor = self.fast.post_processor
        self.specials = processor.num_special_tokens_to_add(False) if processor else 0

    def _conversation(self, req: ChatRequest) -> list[dict[str, Any]]:
        out = []
        for i, m in enumerate(req.messages):
            msg: dict[str, Any] = {
                k: v for k, v in (m.model_extra or {}).items() if k in _KEPT_FIELDS
            }
            role = m.role
            if role == "developer" and not self.knows_developer:
                role = "system"
            msg["role"] = role
            texts = _texts(m.content, i)
            msg["content"] = (
                [{"type": "text", "text": t} for t in texts]
                if self.openai_content
                else "\n".join(texts)
            )
            out.append(msg)
        return out

    def count_chat(self, req: ChatRequest) -> int:
        """Prompt tokens vLLM will see for this chat request."""
        return self.count(*self.inputs(req))[0]

    def inputs(self, req: ChatRequest | CompletionRequest) -> tuple[list[str | int], bool]:
        """What vLLM encodes for this request: per prompt, a text to encode or a known
        count (a token-id prompt); and whether special tokens are added. Raises BadRequest
        when the chat template rejects the messages."""
        if isinstance(req, ChatRequest):
            return [self.render_chat(req)], req.add_special_tokens
        p = req.prompt
        if isinstance(p, str):
            return [p], req.add_special_tokens
        if p and isinstance(p[0], int):
            return [len(p)], req.add_special_tokens
        prompts: list[Any] = list(p)
        return [x if isinstance(x, str) else len(x) for x in prompts], req.add_special_tokens

    def count(self, inputs: list[str | int], special: bool) -> list[int]:
        """Exact token counts of `inputs` (as `inputs` returns them)."""
        texts = [x for x in inputs if isinstance(x, str)]
        lengths = iter(self._lengths(texts, special) if texts else [])
        return [next(lengths) if isinstance(x, str) else x for x in inputs]

    def upper_bound(self, inputs: list[str | int], special: bool) -> list[int]:
        """Counts the exact ones never exceed (the module docstring says why), in
        microseconds: no encoding."""
        norm = self.fast.normalizer
        added = self.specials if special else 0
        return [
            2 * len((norm.normalize_str(x) if norm else x).encode()) + added
            if isinstance(x, str)
            else x
            for x in inputs
        ]

    def render_chat(self, req: ChatRequest) -> str:
        """The chat template applied to the request, as vLLM applies it."""
        if not self.has_template:
            raise TokenizerUnavailable(
                f"the tokenizer from {self.source} has no chat template",
                "serve a model whose tokenizer has one",
            )
        kwargs = dict(req.chat_template_kwargs or {})
        kwargs.update(
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
        )
        try:
            text = self.hf.apply_chat_template(
                self._conversation(req), tools=req.tools, tokenize=False, **kwargs
            )
        except Exception as e:  # the template itself rejects the input (jinja raise_exception)
            raise BadRequest(f"the chat template rejected the messages: {e}") from None
        return str(text)

    def _lengths(self, texts: list[str], special: bool) -> list[int]:
        """Token counts of texts. encode_batch_fast skips the offsets (0.049 against 0.058 ms
        for a 31-token chat, 15 against 25 ms for 11k tokens) and releases the GIL while it
        runs, so a long prompt counted in a worker thread leaves the event loop free. An
        encoding's length, not `len(e.ids)`: `ids` builds a list of Python ints, with the
        GIL held (~30 ms for a million tokens)."""
        return [len(e) for e in self.fast.encode_batch_fast(texts, add_special_tokens=special)]

    def count_completion(self, req: CompletionRequest) -> list[int]:
        """Prompt tokens of each prompt in a completions request."""
        return self.count(*self.inputs(req))


_KEPT_FIELDS = ("name", "tool_calls", "tool_call_id", "reasoning", "reasoning_content")


def _texts(content: str | list[dict[str, Any]] | None, index: int) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    texts = []
    for part in content:
        if part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise BadRequest(
                f"messages[{index}] has a content part of type {part.get('type')!r}; this"
                " gateway serves text models and counts only text parts.",
                'send text as {"type": "text", "text": "..."} or as a plain string.',
                param=f"messages.{index}.content",
            )
    return texts


# What AutoTokenizer reads, and nothing else of a model artifact (never its weights): the
# fast and slow tokenizer files, chat templates, special tokens, generation config, and
# config.json (a few KB: some tokenizers are chosen by the model type written there).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "config.json",
    "tokenizer.model",  # sentencepiece
    "vocab.json",
    "merges.txt",
)
RETRY_FIRST_S = 2.0  # seconds before the first retry of a failed load
RETRY_MAX_S = 300.0  # seconds: the longest wait between two tries


@dataclass(frozen=True)
class LoadFailure:
    """Why a tokenizer source failed to load, how often, and when to try again."""

    error: str  # why the last try failed
    attempts: int  # tries so far
    retry_at: float  # monotonic seconds: the next try is not made before this


def retry_delay(attempts: int, jitter: float) -> float:
    """Seconds to wait after `attempts` failed tries: exponential, capped, with `jitter`
    in [0, 1) spreading gateways that failed together (full jitter over the upper half)."""
    base = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (attempts - 1))
    return base / 2 + base / 2 * jitter


class TokenizerCache:
    """Loads each tokenizer source once (a local folder, else a store ref: only its
    tokenizer files) and keeps it. A failed load is retried after a backoff, not kept."""

    def __init__(
        self, settings: CommonSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._settings = settings
        self._loaded: dict[str, CountingTokenizer] = {}
        self._failed: dict[str, LoadFailure] = {}
        self._clock = clock
        self._lock = threading.Lock()

    def get(self, source: str) -> CountingTokenizer | None:
        """The tokenizer loaded for `source`, or None (nothing is loaded here)."""
        return self._loaded.get(source)

    def failure(self, source: str) -> LoadFailure | None:
        """The last failure of `source` while it has no tokenizer, else None."""
        return None if source in self._loaded else self._failed.get(source)

    def due(self, source: str) -> bool:
        """Whether a load of `source` should be tried now: not loaded, and never failed or
        past its backoff."""
        if source in self._loaded:
            return False
        failed = self._failed.get(source)
        return failed is None or self._clock() >= failed.retry_at

    def load(self, source: str) -> CountingTokenizer:
        """Blocking (seconds on first use): call it from a worker thread."""
        with self._lock:
            if source in self._loaded:
                return self._loaded[source]
            try:
                tok = self._load_hf(source)
            except TokenizerUnavailable as e:
                before = self._failed.get(source)
                attempts = (before.attempts if before else 0) + 1
                wait = retry_delay(attempts, random.random())
                self._failed[source] = LoadFailure(str(e), attempts, self._clock() + wait)
                raise
            self._failed.pop(source, None)
            self._loaded[source] = CountingTokenizer(tok, source)
            # transformers brings hundreds of thousands of long-lived objects: frozen, the
            # full collections stop walking them (they took 20-180 ms each while loading)
            gc.freeze()
            return self._loaded[source]

    def _load_hf(self, source: str) -> Any:
        from transformers import AutoTokenizer

        folder = self._folder(source)
        try:
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as e:
            raise TokenizerUnavailable(
                f"could not load a tokenizer from {folder}: {e}",
                "point LORASTACK_TOKENIZERS at an HF folder or a store ref with tokenizer files",
            ) from None

    def _folder(self, source: str) -> Path:
        path = Path(source).expanduser()
        if path.is_dir():
            return path
        from lorastack.errors import LorastackError
        from lorastack.store import open_store

        try:
            store = open_store(self._settings)
            # only the tokenizer's files: an 8B base's weights would fill the pod's disk
            return store.fetch_files(store.resolve(source), TOKENIZER_FILES)
        except LorastackError as e:
            raise TokenizerUnavailable(
                f"tokenizer source {source!r} is neither a local folder nor a store artifact"
                f" with tokenizer files ({e.message})",
                'set LORASTACK_TOKENIZERS=\'{"MODEL": "/path/to/hf-folder or store-name"}\'',
            ) from None
