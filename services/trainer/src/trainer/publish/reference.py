"""The parity reference of a trained adapter (lorastack.parity): what the model as trained
and evaluated generates from held-out prompts, written into the adapter folder before it
is published, so any deployment can check that it serves the same model.

The model is loaded afresh from the base and the adapter folder about to be published, in
the run's compute dtype (trainer.model.modeling.base_load_kwargs): the adapter published is
the selected checkpoint's, not necessarily the last step's weights that the training model
holds. A QLoRA run's reference is recorded on the unquantised base, the one vLLM and the
merge serve the adapter on, so serving is held to the same limits as any adapter's (on the
nf4 base it trained on, serving differed by the quantisation itself: top-1 80% for the
right adapter, bench/compose); on the nf4 base only when the unquantised one does not fit
the device's free memory, and the run says so. Greedy continuations come from `generate`; the
log-probability of each generated token is read from one teacher-forced forward over
prompt + continuation in float32 (log-softmax of the logits), as vLLM's prompt_logprobs
computes it on the serving side, with the TOP_K most likely tokens at each position (a
parting at serving is a near-tie only where the trained model was unsure too). Generation
stops where vLLM stops: at any end-of-sequence token of the model's generation config.

The control: the same forward with the adapter switched off gives each reference token's
log-probability under the base alone. When the probes barely tell the adapter from its base
(mean distance under MIN_CONTROL nats), more held-out prompts are recorded and the most
telling kept; if even they do not, the run says so (serving then cannot use the control).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lorastack.chat_data import Conversation
from lorastack.errors import Refused
from lorastack.parity import (
    MIN_CONTROL,
    REFERENCE_FILE,
    TOP_K,
    ProbeRecord,
    Reference,
    control_distance,
)
from trainer.config import RunConfig
from trainer.data.samples import render, template_messages
from trainer.model.memory import base_params
from trainer.model.modeling import base_load_kwargs, compute_dtype, read_model_config

PROBES = 8  # held-out prompts recorded
MAX_NEW_TOKENS = 32  # tokens generated per probe


def pick_conversations(
    validation: list[Conversation], test: list[Conversation], n: int = PROBES
) -> list[Conversation]:
    """Up to `n` held-out conversations, validation first (the test split is the
    evaluation's; it is used only when validation is short)."""
    return [*validation, *test][:n]


def stop_ids(model: Any, tokenizer: Any) -> list[int]:
    """The tokens generation stops at, as vLLM reads them: the generation config's
    eos_token_id (an id or a list) and the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return sorted(set(ids))


ROOM_BYTES = 1 << 30  # beside the weights: a probe's logits and log-softmax over the vocab


def recording_quantization(
    config: RunConfig, base_cfg: dict[str, Any], device: torch.device, free_bytes: int | None
) -> tuple[str, str]:
    """The base the reference is recorded on ("none": unquantised, as served) and, when it
    is the run's quantised one, why: the unquantised base in the compute dtype, with 10% and
    ROOM_BYTES to spare, does not fit `free_bytes` (None: not known, tried)."""
    if config.quantization == "none":
        return "none", ""
    linear, other = base_params(base_cfg)
    need = int((linear + other) * compute_dtype(device).itemsize * 1.1) + ROOM_BYTES
    if free_bytes is None or need <= free_bytes:
        return "none", ""
    return config.quantization, (
        f"the unquantised base needs {need / 1e9:.1f} GB and {free_bytes / 1e9:.1f} GB are "
        f"free on {device}"
    )


def free_memory(device: torch.device) -> int | None:
    """Bytes free on `device` now (CUDA, after releasing the allocator's cache); None on
    the CPU, whose memory the run was planned against."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info(device)[0])


def _load_adapted(
    base_dir: Path, adapter_dir: Path, config: RunConfig, device: torch.device, quantization: str
) -> Any:
    """The base model with the published adapter on `device` in the run's compute dtype,
    its base quantised as `quantization` says, in eval mode."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    kwargs = base_load_kwargs(config, device, quantization)
    base: Any = AutoModelForCausalLM.from_pretrained(base_dir, **kwargs)
    if quantization != "nf4":
        base.to(device)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


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
    spare: list[Conversation] | None = None,
    say: Any = None,
) -> Reference:
    """Run the published adapter on `conversations`' prompts and return the reference
    (written by `write_reference`). `spare`: more held-out conversations to record when
    the first do not tell the adapter from its base (MIN_CONTROL)."""
    quantization, why = recording_quantization(
        config, read_model_config(base_dir), device, free_memory(device)
    )
    if why and say is not None:
        say(
            f"parity reference: recorded on the {quantization} base the adapter trained on, "
            f"not the unquantised one it is served on ({why}): serving it unquantised will "
            "differ by the quantisation's gap, and its check warns instead of refusing"
        )
    model = _load_adapted(base_dir, adapter_dir, config, device, quantization)
    stops = stop_ids(model, tokenizer)
    with torch.inference_mode():
        probes = [_probe(model, tokenizer, c, device, stops, max_new_tokens) for c in conversations]
        control = control_distance(probes)
        if spare and control is not None and control < MIN_CONTROL:
            more = [_probe(model, tokenizer, c, device, stops, max_new_tokens) for c in spare]
            probes = sorted([*probes, *more], key=lambda p: -(control_distance([p]) or 0.0))
            probes = probes[: len(conversations)]
            control = control_distance(probes)
    if say is not None and control is not None and control < MIN_CONTROL:
        say(
            f"parity reference: the held-out prompts barely tell the adapter from its base "
            f"(mean {control:.3f} nats < {MIN_CONTROL}): serving cannot check that the adapter "
            "is applied; hold out prompts of the task the adapter was trained for"
        )
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Reference(
        recorded_by="trainer",
        dtype=str(compute_dtype(device)).removeprefix("torch."),
        quantization=quantization,
        trained_quantization="" if quantization == config.quantization else config.quantization,
        device=device.type,
        base_digest=base_digest,
        max_new_tokens=max_new_tokens,
        stop_ids=stops,
        probes=probes,
    )


def _probe(
    model: Any,
    tokenizer: Any,
    conv: Conversation,
    device: torch.device,
    stops: list[int],
    max_new_tokens: int,
) -> ProbeRecord:
    """One probe: greedy continuation, its tokens' log-probs and runner-ups, and the
    base alone's log-probs of the same tokens (the control)."""
    tools = conv.tool_dicts()
    text = render(tokenizer, template_messages(conv)[:-1], prompt=True, tools=tools)
    prompt_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    seq, output_ids = _greedy(model, tokenizer, prompt_ids, device, stops, max_new_tokens)
    at = torch.arange(len(prompt_ids) - 1, len(prompt_ids) + len(output_ids) - 1, device=device)
    chosen = torch.tensor(output_ids, device=device)
    logprobs = torch.log_softmax(model(input_ids=seq).logits[0].float(), dim=-1)[at]
    with model.disable_adapter():
        base_lp = torch.log_softmax(model(input_ids=seq).logits[0].float(), dim=-1)[at]
    top = torch.topk(logprobs, TOP_K, dim=-1)
    values = [
        logprobs[range(len(output_ids)), chosen].tolist(),
        base_lp[range(len(output_ids)), chosen].tolist(),
        top.values.flatten().tolist(),
    ]
    _check_finite(values, text)
    return ProbeRecord(
        messages=conv.message_dicts()[:-1],  # as an OpenAI client sends them
        tools=tools,
        prompt_text=text,
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        output_logprobs=[round(v, 6) for v in values[0]],
        output_text=tokenizer.decode(output_ids, skip_special_tokens=True),
        output_top=[
            {int(t): round(float(v), 6) for t, v in zip(ti, vi, strict=True)}
            for ti, vi in zip(top.indices.tolist(), top.values.tolist(), strict=True)
        ],
        base_logprobs=[round(v, 6) for v in values[1]],
    )


def _greedy(
    model: Any,
    tokenizer: Any,
    prompt_ids: list[int],
    device: torch.device,
    stops: list[int],
    max_new_tokens: int,
) -> tuple[torch.Tensor, list[int]]:
    """The greedy continuation of `prompt_ids` up to its first stop token (kept): the
    whole sequence ([1, prompt + output]) and the output's ids."""
    ids = torch.tensor([prompt_ids], device=device)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=stops,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0],
    )
    output_ids = out[0, len(prompt_ids) :].tolist()
    ends = [i for i, t in enumerate(output_ids) if t in stops]
    if ends:  # generate pads past the stop when batching; keep the stop
        output_ids = output_ids[: ends[0] + 1]
    return out[:, : len(prompt_ids) + len(output_ids)], output_ids


def _check_finite(values: list[list[float]], text: str) -> None:
    """Raise Refused where a recorded log-prob list of the prompt `text` holds NaN or inf."""
    if not all(bool(torch.isfinite(torch.tensor(v)).all()) for v in values):
        raise Refused(
            f"the trained model's log-probabilities on a held-out prompt are not finite "
            f"(NaN or inf: {text[-60:]!r})",
            "the run diverged or its dtype overflowed: check the loss curve, lower the "
            "learning rate, or train in bfloat16/float32",
        )


def write_reference(reference: Reference, folder: Path) -> Path:
    """Write the parity reference into the adapter folder; its path."""
    path = folder / REFERENCE_FILE
    path.write_text(reference.model_dump_json(indent=1) + "\n")
    return path
