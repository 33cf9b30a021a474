"""The parity reference of a trained adapter (lorastack.parity): what the model as trained
and evaluated generates from held-out prompts, written into the adapter folder before it
is published, so any deployment can check that it serves the same model.

The model is loaded afresh from the base and the adapter folder about to be published, in
the run's compute dtype and quantisation (trainer.model.modeling.base_load_kwargs): the
adapter published is the selected checkpoint's, not necessarily the last step's weights
that the training model holds. Greedy continuations come from `generate`; the
log-probability of each generated token is read from one teacher-forced forward over
prompt + continuation in float32 (log-softmax of the logits), as vLLM's prompt_logprobs
computes it on the serving side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lorastack.chat_data import Conversation
from lorastack.parity import REFERENCE_FILE, ProbeRecord, Reference
from trainer.config import RunConfig
from trainer.data.samples import render, template_messages
from trainer.model.modeling import base_load_kwargs, compute_dtype

PROBES = 8  # held-out prompts recorded
MAX_NEW_TOKENS = 32  # tokens generated per probe


def pick_conversations(
    validation: list[Conversation], test: list[Conversation], n: int = PROBES
) -> list[Conversation]:
    """Up to `n` held-out conversations, validation first (the test split is the
    evaluation's; it is used only when validation is short)."""
    return [*validation, *test][:n]


def record_reference(
    *,
    base_dir: Path,
    adapter_dir: Path,
    config: RunConfig,
    device: torch.device,
    tokenizer: Any,
    conversations: list[Conversation],
    base_digest: str,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> Reference:
    """Run the published adapter on `conversations`' prompts and return the reference
    (written by `write_reference`)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base: Any = AutoModelForCausalLM.from_pretrained(base_dir, **base_load_kwargs(config, device))
    if config.quantization != "nf4":
        base.to(device)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    stop = int(tokenizer.eos_token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop
    probes = []
    with torch.inference_mode():
        for conv in conversations:
            tools = conv.tool_dicts()
            text = render(tokenizer, template_messages(conv)[:-1], prompt=True, tools=tools)
            prompt_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            ids = torch.tensor([prompt_ids], device=device)
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=stop,
                pad_token_id=pad,
            )
            output_ids = out[0, len(prompt_ids) :].tolist()
            if stop in output_ids:  # generate pads past the stop when batching; keep the stop
                output_ids = output_ids[: output_ids.index(stop) + 1]
            logits = model(input_ids=out[:, : len(prompt_ids) + len(output_ids)]).logits[0]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            at = torch.arange(len(prompt_ids) - 1, len(prompt_ids) + len(output_ids) - 1)
            chosen = logprobs[at.to(logprobs.device), torch.tensor(output_ids, device=device)]
            probes.append(
                ProbeRecord(
                    messages=conv.message_dicts()[:-1],  # as an OpenAI client sends them
                    tools=tools,
                    prompt_text=text,
                    prompt_ids=prompt_ids,
                    output_ids=output_ids,
                    output_logprobs=[round(float(v), 6) for v in chosen.tolist()],
                    output_text=tokenizer.decode(output_ids, skip_special_tokens=True),
                )
            )
    del model, base
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Reference(
        recorded_by="trainer",
        dtype=str(compute_dtype(device)).removeprefix("torch."),
        quantization=config.quantization,
        device=device.type,
        base_digest=base_digest,
        max_new_tokens=max_new_tokens,
        probes=probes,
    )


def write_reference(reference: Reference, folder: Path) -> Path:
    """Write the parity reference into the adapter folder; its path."""
    path = folder / REFERENCE_FILE
    path.write_text(reference.model_dump_json(indent=1) + "\n")
    return path
