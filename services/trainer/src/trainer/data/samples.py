"""Conversations to token ids and labels, through the model's own chat template.

Owns rendering (the exact text the model sees), tokenising with char offsets, and
handing both to the pure masking functions. It never truncates: a sample longer than
the maximum is reported by the preflight and refused or dropped there.

Tool-calling chats render with `tools=` and their messages keep their `tool_calls`; an
assistant turn that calls tools is supervised from its header to its end-of-turn (the
calls as the template writes them), and tool results are context like user turns. A
template without tool support, or one that drops a function, a call or a result from
the text, is refused (MaskingError) rather than trained on.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from lorastack.chat_data import Conversation
from trainer.data.chat_templates import NoToolSupport, require_tool_support
from trainer.data.masking import (
    MaskingError,
    Span,
    check_tools_rendered,
    labels_from_mask,
    locate_calls,
    locate_target,
    part_lengths,
    supervised_mask,
)

LossOn = Literal["all_assistant", "last_assistant"]


@dataclass
class Sample:
    """One conversation encoded for training: token ids, labels and its parts' lengths."""

    input_ids: list[int]
    labels: list[int]  # aligned with input_ids; IGNORE where not supervised
    parts: dict[str, int]  # tokens: system, history, target (the last target + end-of-turn)
    rendered: str
    offsets: list[tuple[int, int]] = field(repr=False)

    @property
    def length(self) -> int:
        return len(self.input_ids)

    @property
    def supervised(self) -> int:
        return sum(1 for x in self.labels if x != -100)

    def lean(self) -> Sample:
        """Without the text and its offsets, which only `data inspect` reads: what a run
        keeps of each sample, and a fraction of the bytes a worker process sends back."""
        return Sample(self.input_ids, self.labels, self.parts, "", [])


def end_of_turn_id(tokenizer: Any) -> int:
    """The token that ends an assistant turn: the tokenizer's eos (`<|im_end|>`)."""
    eid = tokenizer.eos_token_id
    if eid is None:
        raise MaskingError("the tokenizer has no eos token; set eos_token to the end-of-turn token")
    return int(eid)


class SpecialTokens(NamedTuple):
    """The tokens a run's batches and checks are built with."""

    eot: int  # ends an assistant turn (end_of_turn_id)
    pad: int  # pads a row: the tokenizer's pad token, else the end-of-turn token


def special_tokens(tokenizer: Any) -> SpecialTokens:
    """The end-of-turn and padding tokens of `tokenizer`."""
    eot = end_of_turn_id(tokenizer)
    pad = tokenizer.pad_token_id
    return SpecialTokens(eot, eot if pad is None else int(pad))


def template_hash(tokenizer: Any) -> str:
    """'sha256:' and the hash of the tokenizer's chat template ('' when it has none)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "sha256:" + hashlib.sha256(str(template).encode()).hexdigest()


def render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    prompt: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The messages rendered as text by the chat template (`tools` passed only when given)."""
    kwargs = {"tools": tools} if tools else {}  # a plain chat renders as it always did
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=prompt, **kwargs
    )
    return str(text)


def render_conv(tokenizer: Any, conv: Conversation) -> str:
    """The whole conversation as the model sees it in training."""
    return render(tokenizer, template_messages(conv), tools=conv.tool_dicts())


def encode(conv: Conversation, tokenizer: Any, loss_on: LossOn) -> Sample:
    """Render `conv` and label its assistant targets; raises MaskingError when the
    template does not put each target verbatim between its header and end-of-turn."""
    if conv.has_tools:
        try:
            require_tool_support(tokenizer)
        except NoToolSupport as e:
            raise MaskingError(str(e)) from None
    msgs, tools = template_messages(conv), conv.tool_dicts()
    rendered = render(tokenizer, msgs, tools=tools)
    if conv.has_tools:
        check_tools_rendered(
            rendered,
            [t.function.name for t in conv.tools or []],
            [m.text for m in conv.messages if m.role == "tool"],
        )
    assistant_at = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if loss_on == "last_assistant":
        assistant_at = assistant_at[-1:]
    spans: list[Span] = []
    for i in assistant_at:
        prompt = render(tokenizer, msgs[:i], prompt=True, tools=tools)
        if not rendered.startswith(prompt):
            raise MaskingError("the chat template renders a conversation's prefix differently")
        calls = conv.messages[i].tool_calls
        if calls:
            named = [(c.function.name, list(c.function.parsed_arguments())) for c in calls]
            spans.append(locate_calls(rendered, len(prompt), str(tokenizer.eos_token or ""), named))
        else:
            spans.append(locate_target(rendered, len(prompt), msgs[i]["content"]))
    enc = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    offsets = [(s, e) for s, e in enc["offset_mapping"]]
    eot = end_of_turn_id(tokenizer)
    mask = supervised_mask(offsets, ids, spans, eot)
    last = spans[-1]
    eot_end = next(e for (s, e), t in zip(offsets, ids, strict=True) if s >= last.end and t == eot)
    first_user = next(str(m["content"]) for m in msgs if m["role"] == "user")
    user_at = rendered.find(first_user)
    header = rendered.rfind(str(tokenizer.bos_token or ""), 0, user_at) if user_at > 0 else 0
    system_end = header if header > 0 else max(user_at, 0)
    parts = part_lengths(offsets, system_end, Span(last.start, eot_end))
    return Sample(ids, labels_from_mask(ids, mask), parts, rendered, offsets)


class Pretokenized:
    """`tokenizer`, with the encodings `encode` asks for computed up front in one call for
    a batch of conversations: the Rust tokenizer encodes a batch on every core without
    the GIL, and one call skips the per-text wrapping that dominated a call per sample.
    Any other call (and any text it does not know) goes to the tokenizer itself."""

    def __init__(self, tokenizer: Any, convs: list[Conversation]) -> None:
        self._tokenizer = tokenizer
        texts = []
        for conv in convs:
            with contextlib.suppress(Exception):  # encode() itself reports what fails
                texts.append(render_conv(tokenizer, conv))
        self._known: dict[str, dict[str, Any]] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)  # fast tokenizers only
        if texts and backend is not None:
            encs = backend.encode_batch(texts, add_special_tokens=False)
            for text, enc in zip(texts, encs, strict=True):
                self._known[text] = {"input_ids": enc.ids, "offset_mapping": enc.offsets}

    def __call__(self, text: Any, **kwargs: Any) -> Any:
        wanted = kwargs == {"add_special_tokens": False, "return_offsets_mapping": True}
        if wanted and isinstance(text, str) and text in self._known:
            return self._known[text]
        return self._tokenizer(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def template_messages(conv: Conversation) -> list[dict[str, Any]]:
    """The messages as templates take them: tool-call arguments parsed into objects
    (templates write `arguments | tojson`; a string would be quoted twice)."""
    out = conv.message_dicts()
    for d, m in zip(out, conv.messages, strict=True):
        if m.tool_calls:
            d["tool_calls"] = [c.as_dict() for c in m.tool_calls]
    return out


def prompt_ids(conv: Conversation, tokenizer: Any) -> list[int]:
    """Token ids of everything before the last assistant answer, in the serving format
    (chat template with the generation prompt)."""
    msgs = template_messages(conv)[:-1]
    text = render(tokenizer, msgs, prompt=True, tools=conv.tool_dicts())
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
