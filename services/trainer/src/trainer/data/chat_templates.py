"""Which chat template a run renders with, and whether it can render tool calls.

Owns the run config's `chat_template` choice (the base model's own, a template shipped
here by name, or a .jinja file), setting it on the tokenizer (which the adapter folder
then carries, so the merged model and vLLM render the same way), and the tool-support
check: a template that never mentions `tools` and `tool_calls` would silently drop the
functions and the calls, and the model would be trained on answers to calls it never
saw. Does not own: rendering and masking (`trainer.data.samples`).

Shipped: `chatml-tools` (templates/chatml-tools.jinja), SmolLM2-Instruct's ChatML with
the same default system prompt (a chat without tools renders byte for byte as SmolLM2's
own template renders it) plus Hermes-style tool calling, the format vLLM's `hermes` tool
parser reads back into `tool_calls`.

The published adapter's manifest records what serving needs (`chat_format_record`, in
`metadata.chat_format`): the template's sha256 and file, and the vLLM tool parser when the
run trained on tool-calling chats, so the inference service sets vLLM's flags itself.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path
from typing import Any

from lorastack.errors import ConfigError, NotFound

SHIPPED = {"chatml-tools": "chatml-tools.jinja"}
TOOLS_HINT = (
    "set chat_template: chatml-tools in the run config (ChatML with Hermes-style "
    "<tool_call> blocks, shipped with the trainer) or the path of a .jinja template that "
    "renders `tools` and `tool_calls`"
)


class NoToolSupport(ValueError):
    """The chat template cannot render a tool-calling conversation."""


def template_text(choice: str) -> str:
    """The text of a shipped template (by name) or of a .jinja file (by path)."""
    if choice in SHIPPED:
        return (resources.files("trainer") / "templates" / SHIPPED[choice]).read_text("utf-8")
    path = Path(choice)
    if not path.is_file():
        raise NotFound(
            f"chat_template {choice!r} is neither a shipped template nor a file",
            f"use one of {', '.join(SHIPPED)} or the path of a .jinja file",
        )
    text = path.read_text("utf-8")
    if "messages" not in text:
        raise ConfigError(
            f"chat_template {choice!r} never reads `messages`: it is not a chat template",
            "give a Jinja chat template (the chat_template.jinja of an HF model folder)",
        )
    return text


def apply_choice(tokenizer: Any, choice: str | None) -> Any:
    """Set the run's template on `tokenizer` (None keeps the model's own); returns it."""
    if choice is not None:
        tokenizer.chat_template = template_text(choice)
    return tokenizer


def supports_tools(tokenizer: Any) -> bool:
    """The template reads both the functions (`tools`) and the calls (`tool_calls`)."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    return "tools" in template.replace("tool_calls", "") and "tool_calls" in template


def require_tool_support(tokenizer: Any) -> None:
    """Raise NoToolSupport if the tokenizer's chat template cannot render tools."""
    if not supports_tools(tokenizer):
        raise NoToolSupport(
            "the chat template has no tool support (it never renders `tools` and "
            f"`tool_calls`): {TOOLS_HINT}"
        )


def tool_call_parser(template: str) -> str | None:
    """The vLLM tool parser that reads the calls this template writes: `hermes` for JSON in
    `<tool_call>` blocks (chatml-tools, Hermes, Qwen), None when unknown."""
    return "hermes" if "<tool_call>" in template and "</tool_call>" in template else None


def chat_format_record(
    template: str, choice: str | None, template_file: str, trained_on_tools: bool
) -> dict[str, Any]:
    """What the adapter was trained with, for serving it the same way (inference.chat_format)."""
    return {
        "template": choice or "",  # "" = the base model's own
        "template_file": template_file,
        "template_sha256": hashlib.sha256(template.encode("utf-8")).hexdigest(),
        "tools": trained_on_tools,
        "tool_call_parser": tool_call_parser(template) if trained_on_tools else None,
    }
