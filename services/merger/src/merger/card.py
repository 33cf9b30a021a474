"""What a merged folder says about itself besides its weights: the stop tokens of its
generation config and the model card (README.md) with the lineage and the verification.

Pure: takes the tokenizer's facts and the manifests' data, returns values and text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# End-of-turn tokens of common chat templates: ChatML (<|im_end|>), Llama 3 (<|eot_id|>),
# Gemma (<end_of_turn>), Phi-3 (<|end|>). One counts only if the chat template emits it.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


def stop_token_ids(
    eos_id: int | None,
    configured: int | list[int] | None,
    chat_template: str,
    vocab: Mapping[str, int],
) -> list[int]:
    """Every token that ends a reply: the tokenizer's eos, the configured eos, and the
    end-of-turn token the chat template writes after each message."""
    ids: list[int] = []
    for cand in (
        eos_id,
        *(configured if isinstance(configured, list) else [configured]),
        *(vocab.get(t) for t in END_OF_TURN_TOKENS if t in chat_template),
    ):
        if cand is not None and cand not in ids:
            ids.append(int(cand))
    return ids


def render_card(name: str, lineage: Mapping[str, Any], report: Mapping[str, Any]) -> str:
    """README.md for a merged model: where it came from and how it was verified."""
    m = report["merged"]
    t = report["thresholds"]
    lines = [
        f"# {name}",
        "",
        f"A LoRA adapter merged into its base model in float32, saved as {report['dtype']}, "
        "by the lorastack merger. It loads as a plain Hugging Face model (vLLM, transformers).",
        "",
        "## Lineage",
        "",
        "| role | artifact | digest |",
        "|---|---|---|",
    ]
    lines += _lineage_rows(lineage)
    lines += [
        "",
        "## Verification (before publishing)",
        "",
        f"Reference: base + adapter unmerged in float32, on {report['probes']['count']} "
        f"probe conversations from `{report['probes']['source']}`.",
        "",
        "| check | measured | threshold |",
        "|---|---|---|",
        f"| max abs logit difference | {m['max_abs_logit_diff']:.4g} | <= {t['max_abs_logit']:g} |",
        f"| top-1 agreement, all positions | {m['top1_agreement']:.2%} | >= {t['min_top1']:.1%} |",
        f"| greedy generations identical | {m['greedy_identical']}/{m['greedy_probes']} | "
        f">= {t['min_greedy_identical']:.0%} |",
    ]
    if report.get("dtype_only"):
        d = report["dtype_only"]
        lines += [
            "",
            f"The {report['dtype']} cast alone (unmerged, {report['dtype']} vs float32): max "
            f"abs logit difference {d['max_abs_logit_diff']:.4g}, top-1 agreement "
            f"{d['top1_agreement']:.2%}.",
        ]
    lines += [
        "",
        f"Result: **{'passed' if report['passed'] else 'FAILED'}**. Details: `merge-report.json`.",
        "",
    ]
    return "\n".join(lines)


def _lineage_rows(lineage: Mapping[str, Any]) -> list[str]:
    """The lineage table's rows: the base, dataset and adapter, the run's config digests."""
    lines: list[str] = []
    for role in ("base", "dataset", "adapter"):
        item = lineage.get(role)
        if item:
            lines.append(f"| {role} | `{item['ref']}` | `{item['digest']}` |")
    for key, label in (
        ("run_config_digest", "run config (adapter manifest config)"),
        ("run_manifest_sha256", "run-manifest.json"),
    ):
        if lineage.get(key):
            lines.append(f"| {label} | | `{lineage[key]}` |")
    return lines
