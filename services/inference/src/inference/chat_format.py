"""How vLLM renders chats and reads tool calls, taken from what the served artifacts record.

Owns the choice of `--chat-template`, `--enable-auto-tool-choice` and `--tool-call-parser`
for one server, and the refusal of an adapter that this choice would serve wrong. Does not
own fetching the artifacts (`inference.artifacts`) nor the command line (`inference.engine`).

What vLLM does (0.32, read in its source): every chat request of a server is rendered with
ONE template, the `--chat-template` file or else the served model folder's own; a LoRA
request too (the OpenAI renderer holds the server's tokenizer; a LoRA folder's tokenizer
files and chat_template.jinja are never read). The tool parser is per server as well.

What the trainer records (`metadata.chat_format` of an adapter manifest, copied by the
merger onto the merged model): the sha256 of the template the adapter was trained with
(`template_file` in its folder) and `tool_call_parser` ("hermes") when it was trained on
tool-calling chats with a template that writes Hermes `<tool_call>` blocks. So:

- a merged model carries its template in its own folder: only the tool flags are added;
- base + LoRAs: an adapter trained with another template than the base's own makes that
  template the server's `--chat-template`; adapters trained with two different templates
  cannot share a server (refused at start); an adapter loaded later (admin, declared) whose
  template or parser the running server lacks is refused with what to change.

A user's own flags in `extra_vllm_args` win: `--chat-template` there replaces ours (and the
template checks are off); `--tool-call-parser` there must be the recorded parser, or the
start is refused (the model writes calls that parser cannot read). An artifact without a
record (published before the trainer wrote one) asks for nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorastack.errors import ConfigError, Refused
from lorastack.manifest import Manifest

TEMPLATE_FLAG = "--chat-template"
PARSER_FLAG = "--tool-call-parser"
AUTO_TOOL_FLAG = "--enable-auto-tool-choice"


@dataclass(frozen=True)
class Recorded:
    """What one artifact says it was trained for (`metadata.chat_format`)."""

    ref: str
    template_sha256: str
    template_file: str  # in the artifact's folder
    template_name: str  # "chatml-tools", a file name, or "" for the base model's own
    tool_call_parser: str | None


@dataclass(frozen=True)
class ChatFormat:
    """What every request of this server is rendered and parsed with."""

    template: Path | None  # our --chat-template file; None: the model folder's own (or user's)
    template_sha256: str | None  # of the template in use; None: the user's, not checked
    template_from: str  # the artifact ref it came from, "model folder" or "extra_vllm_args"
    tool_call_parser: str | None
    parser_from: str  # the artifact ref that asked for the parser, or "extra_vllm_args"

    def describe(self) -> dict[str, Any]:
        """The chat template and the tool-call parser, and where each came from."""
        return {
            "template": str(self.template) if self.template else None,
            "template_sha256": self.template_sha256,
            "template_from": self.template_from,
            "tool_call_parser": self.tool_call_parser,
            "parser_from": self.parser_from or None,
        }


def recorded(manifest: Manifest) -> Recorded | None:
    """The chat format an artifact's manifest recorded at training (None: it recorded none)."""
    data = manifest.metadata.get("chat_format")
    if not isinstance(data, dict) or not data.get("template_sha256"):
        return None
    return Recorded(
        ref=manifest.ref,
        template_sha256=str(data["template_sha256"]),
        template_file=str(data.get("template_file") or "chat_template.jinja"),
        template_name=str(data.get("template") or ""),
        tool_call_parser=data.get("tool_call_parser") or None,
    )


def folder_template(folder: Path) -> str | None:
    """The chat template an HF folder carries (chat_template.jinja, else tokenizer_config)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text("utf-8")
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text("utf-8"))
    except (OSError, ValueError):
        return None
    template = config.get("chat_template")
    return template if isinstance(template, str) else None


def text_sha256(text: str) -> str:
    """The SHA-256 hex digest of `text` in UTF-8."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of `flag` in an argument list (`--flag VALUE` or `--flag=VALUE`)."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _label(r: Recorded) -> str:
    return f"{r.ref} (template {r.template_name or 'of its base'}, sha256 {r.template_sha256[:12]})"


def _tool_parser(
    model_rec: Recorded | None,
    adapter_recs: list[tuple[Recorded, Path]],
    extra_args: Sequence[str],
) -> tuple[str | None, str]:
    """The tool-call parser the artifacts were trained for (or the user's, where it agrees)
    and what says so; ConfigError where they disagree."""
    parsers = {
        r.ref: r.tool_call_parser
        for r in [model_rec, *(r for r, _ in adapter_recs)]
        if r is not None and r.tool_call_parser
    }
    if len(set(parsers.values())) > 1:
        raise ConfigError(
            "the served artifacts were trained for different tool-call parsers: "
            + ", ".join(f"{ref}: {p}" for ref, p in parsers.items()),
            "vLLM reads tool calls with one parser per server: serve them on separate servers",
        )
    parser = next(iter(parsers.values()), None)
    parser_from = next(iter(parsers), "")
    user_parser = flag_value(extra_args, PARSER_FLAG)
    if parser and user_parser and user_parser != parser:
        raise ConfigError(
            f"extra_vllm_args sets {PARSER_FLAG} {user_parser}, but {parser_from} was trained "
            f"to write tool calls for the {parser!r} parser, which {user_parser!r} cannot read",
            f"remove {PARSER_FLAG} {user_parser} from extra_vllm_args (the service adds "
            f"{PARSER_FLAG} {parser} itself) or set it to {parser}",
        )
    if user_parser:
        parser, parser_from = user_parser, "extra_vllm_args"
    return parser, parser_from


def plan_chat_format(
    model_path: Path,
    model_manifest: Manifest,
    adapters: Sequence[tuple[Manifest, Path]],
    extra_args: Sequence[str] = (),
) -> ChatFormat:
    """The server's template and parser for the model and the adapters listed at start;
    ConfigError on a contradiction, saying what to change."""
    own = folder_template(model_path)
    own_sha = text_sha256(own) if own is not None else None
    model_rec = recorded(model_manifest)
    adapter_recs = [(r, path) for m, path in adapters if (r := recorded(m)) is not None]
    parser, parser_from = _tool_parser(model_rec, adapter_recs, extra_args)
    if flag_value(extra_args, TEMPLATE_FLAG) is not None:
        return ChatFormat(None, None, "extra_vllm_args", parser, parser_from)
    foreign = [(r, p) for r, p in adapter_recs if r.template_sha256 != own_sha]
    if not foreign:
        return ChatFormat(None, own_sha, "model folder", parser, parser_from)
    first, folder = foreign[0]
    same = [r for r, _ in foreign if r.template_sha256 == first.template_sha256]
    others = [r for r, _ in adapter_recs if r.template_sha256 != first.template_sha256]
    if others:
        raise ConfigError(
            "the adapters were trained with different chat templates, and vLLM renders every "
            "request of a server (LoRA requests too) with one: "
            + "; ".join(_label(r) for r in [*same, *others]),
            "serve them on separate servers, or give one template for all with "
            f"extra_vllm_args: [{TEMPLATE_FLAG}, FILE] (your flag wins)",
        )
    path = folder / first.template_file
    text = path.read_text("utf-8") if path.is_file() else None
    if text is None or text_sha256(text) != first.template_sha256:
        raise ConfigError(
            f"{first.ref} records a chat template ({first.template_file}, sha256 "
            f"{first.template_sha256[:12]}) that its folder does not hold",
            "publish the adapter folder the trainer wrote (with its chat_template.jinja)",
        )
    return ChatFormat(path, first.template_sha256, first.ref, parser, parser_from)


def vllm_flags(fmt: ChatFormat, extra_args: Sequence[str]) -> list[str]:
    """The flags to add to vLLM's command line besides the user's own."""
    flags: list[str] = []
    if fmt.template is not None and flag_value(extra_args, TEMPLATE_FLAG) is None:
        flags += [TEMPLATE_FLAG, str(fmt.template)]
    if fmt.tool_call_parser:
        if AUTO_TOOL_FLAG not in extra_args:
            flags.append(AUTO_TOOL_FLAG)
        if flag_value(extra_args, PARSER_FLAG) is None:
            flags += [PARSER_FLAG, fmt.tool_call_parser]
    return flags


def check_adapter(fmt: ChatFormat, manifest: Manifest) -> None:
    """Refuse an adapter loaded after start that this server would render or parse wrong."""
    r = recorded(manifest)
    if r is None:
        return
    restart = (
        "list it under adapters in the serve config and restart (the template and the tool "
        "parser are chosen when vLLM starts), or serve it on a server of its own"
    )
    if fmt.template_sha256 is not None and r.template_sha256 != fmt.template_sha256:
        raise Refused(
            f"{_label(r)} was trained with another chat template than this server renders "
            f"with (sha256 {fmt.template_sha256[:12]}, from {fmt.template_from})",
            restart,
        )
    if r.tool_call_parser and r.tool_call_parser != fmt.tool_call_parser:
        raise Refused(
            f"{r.ref} was trained to write tool calls for the {r.tool_call_parser!r} parser; "
            f"this server runs {fmt.tool_call_parser or 'no tool parser'}",
            restart,
        )
