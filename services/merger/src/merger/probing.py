"""What a merged model is checked on: probe conversations from the adapter's held-out
split, tokenised once (the prompt, and the whole conversation), and what a model produces
on them (teacher-forced logits, greedy tokens), compared with verify.Comparison.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorastack.chat_data import load_jsonl
from lorastack.errors import Refused
from merger.card import stop_token_ids
from merger.inputs import Inputs, read_json
from merger.settings import MergerSettings
from merger.verify import Comparison, Probe, pick_probes

PROBE_MAX_TOKENS = 2048  # tokens per probe conversation; longer ones are skipped (reported)
TOKENIZER_FILES = ("tokenizer_config.json",)  # an artifact that has it carries a tokenizer


@dataclass
class ModelRun:
    """What one model produced on the probes."""

    logits: list[Any]  # per probe: [positions, vocab] float32 tensor
    tokens: list[list[int]]  # per probe: greedily generated token ids


def _load_probes(dataset_dir: Path, n: int) -> tuple[list[Probe], str]:
    for split in ("validation.jsonl", "train.jsonl"):
        path = dataset_dir / split
        if path.is_file() and path.stat().st_size:
            return pick_probes(load_jsonl(path), n), split
    raise Refused(
        "the adapter's dataset has neither validation.jsonl nor train.jsonl to take probes from",
        "merge an adapter whose dataset artifact holds its validation split",
    )


def _encode(tok: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    out = tok.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=True
    )
    return list(out["input_ids"])


def run_probes(model: Any, encoded: list[tuple[list[int], list[int]]], gen: Any) -> ModelRun:
    """Teacher-forced logits over each whole conversation; greedy tokens from its prompt."""
    import torch

    logits, tokens = [], []
    dev = model.device
    with torch.inference_mode():
        for prompt, full in encoded:
            ids = torch.tensor([full], device=dev)
            logits.append(model(input_ids=ids).logits[0].float().cpu())
            p = torch.tensor([prompt], device=dev)
            out = model.generate(
                input_ids=p, attention_mask=torch.ones_like(p), generation_config=gen
            )
            tokens.append(out[0, len(prompt) :].tolist())
    return ModelRun(logits, tokens)


def adapter_effect(
    model: Any, encoded: list[tuple[list[int], list[int]]], ref: ModelRun
) -> Comparison:
    """Base alone vs base + adapter: how much the adapter moves the logits. Near zero
    means an untrained adapter (lora_B still zero), and then verification proves little."""
    import torch

    c = Comparison()
    with torch.inference_mode(), model.disable_adapter():
        for (_, full), ref_logits in zip(encoded, ref.logits, strict=True):
            ids = torch.tensor([full], device=model.device)
            c.add_logits(ref_logits, model(input_ids=ids).logits[0].float().cpu())
    return c


def compare(ref: ModelRun, other: ModelRun) -> Comparison:
    """Compare two runs over the probes: logits position by position, greedy tokens."""
    c = Comparison()
    for rl, ol, rt, ot in zip(ref.logits, other.logits, ref.tokens, other.tokens, strict=True):
        c.add_logits(rl, ol)
        c.add_generation(rt, ot)
    return c


@dataclass
class Probing:
    """The tokenizer and the tokenised probes every model is run on."""

    tokenizer: Any
    stops: list[int]  # token ids that end a reply
    pad: int
    generation: Any  # transformers.GenerationConfig, greedy
    encoded: list[tuple[list[int], list[int]]]  # per probe: (prompt ids, whole conversation ids)
    source: str  # the split the probes came from
    skipped: list[int]  # probe indices longer than PROBE_MAX_TOKENS


def prepare_probes(settings: MergerSettings, inputs: Inputs, n: int) -> Probing:
    """The probe conversations (held-out validation) and the tokenizer and template to run them."""
    from transformers import AutoTokenizer, GenerationConfig

    probes, source = _load_probes(inputs.dataset_dir, n)
    has_tok = (inputs.adapter_dir / TOKENIZER_FILES[0]).is_file()
    tok = AutoTokenizer.from_pretrained(inputs.adapter_dir if has_tok else inputs.base_dir)
    template = tok.chat_template or ""
    if not template:
        raise Refused(
            f"neither the adapter nor the base {inputs.base.ref} carries a chat template",
            "publish the base with its tokenizer's chat template (the trainer needs it too)",
        )
    gen_path = inputs.base_dir / "generation_config.json"
    base_gen = read_json(gen_path) if gen_path.is_file() else {}
    stops = stop_token_ids(
        tok.eos_token_id, base_gen.get("eos_token_id"), template, tok.get_vocab()
    )
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]
    gen = GenerationConfig(
        max_new_tokens=settings.merge_probe_new_tokens,
        do_sample=False,
        eos_token_id=stops,
        pad_token_id=pad,
    )
    encoded, skipped = [], []
    for p in probes:
        full = _encode(tok, p.full, generation_prompt=False)
        if len(full) > PROBE_MAX_TOKENS:
            skipped.append(p.index)
            continue
        encoded.append((_encode(tok, p.prompt, generation_prompt=True), full))
    if not encoded:
        raise Refused(
            f"every probe conversation in {source} is longer than {PROBE_MAX_TOKENS} tokens",
            "add shorter conversations to the validation split",
        )
    return Probing(tok, stops, pad, gen, encoded, source, skipped)
