"""`run_eval`: ask both models every test prompt, score the answers, decide per metric.

Reading top to bottom: resolve the data (test split, adapter numbers), build the two
prompts of each item (baseline = base model + system prompt/few-shot; candidate = the
LoRA on the item's own prompt), send them with bounded concurrency (greedy, bounded
max_tokens), score every answer with every scorer, bootstrap each metric, then write
samples.jsonl, report.json and report.md (and publish them when asked).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from evaluation.endpoint import (
    EndpointError,
    api_root,
    list_models,
    make_client,
    post_json,
)
from evaluation.eval_config import EvalConfig
from evaluation.eval_data import (
    TestSet,
    TrainingEvidence,
    read_training_evidence,
    resolve_test_set,
)
from evaluation.eval_report import Answer, EvalReport, Sample, build_report, write_report
from evaluation.scorers import NamedScorer, build_scorer
from evaluation.tool_calls import calls_text, message_calls
from evaluation.verdict import PairedResult, paired_bootstrap
from lorastack.chat_data import Conversation
from lorastack.errors import ConfigError
from lorastack.store import ArtifactStore

Messages = list[dict[str, Any]]


def split_item(conv: Conversation) -> tuple[Messages, str]:
    """(prompt messages, reference): everything before the final assistant turn, and it
    (a turn that calls tools: its calls in `evaluation.tool_calls`' text form)."""
    msgs, last = conv.message_dicts(), conv.messages[-1]
    if last.tool_calls:
        return msgs[:-1], calls_text(
            [(c.function.name, c.function.arguments) for c in last.tool_calls]
        )
    return msgs[:-1], last.text


def baseline_prompt(prompt: Messages, config: EvalConfig) -> Messages:
    """The item's prompt with the configured system prompt and few-shot pairs in front."""
    system = [m for m in prompt[:1] if m["role"] == "system"]
    rest = prompt[len(system) :]
    if config.system_prompt is not None:
        system = [{"role": "system", "content": config.system_prompt}]
    shots: Messages = []
    for ex in config.few_shot:
        shots += [
            {"role": "user", "content": ex.user},
            {"role": "assistant", "content": ex.assistant},
        ]
    return system + shots + rest


async def _ask(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    messages: Messages,
    config: EvalConfig,
    gate: asyncio.Semaphore,
    tools: list[dict[str, Any]] | None = None,
) -> Answer:
    payload: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "temperature": 0.0,  # greedy
        "max_tokens": config.max_tokens,
        "seed": config.seed,
        "stream": False,
    }
    if tools:
        payload["tools"] = tools
    async with gate:
        start = time.perf_counter()
        try:
            data = await post_json(client, url, payload)
        except EndpointError as e:
            if e.status in (401, 403, 404):  # the same for every item: stop at once
                raise
            return Answer(
                model=model, output="", error=e.message, latency_s=time.perf_counter() - start
            )
    latency = time.perf_counter() - start
    try:
        choice = data["choices"][0]
        text = choice["message"].get("content") or ""
        if tools and (calls := message_calls(choice["message"])):
            text = calls_text(calls)
        finish = str(choice.get("finish_reason") or "")
    except (KeyError, IndexError, TypeError, AttributeError):
        return Answer(
            model=model, output="", error=f"unexpected answer: {str(data)[:200]}", latency_s=latency
        )
    usage = data.get("usage") or {}
    return Answer(
        model=model,
        output=text,
        finish_reason=finish,
        latency_s=latency,
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
    )


async def _check_models(client: httpx.AsyncClient, root: str, config: EvalConfig) -> None:
    models = await list_models(client, root)
    if models is None:
        return  # the endpoint does not list models; the first request will tell
    for name in (config.base_model, config.lora_model):
        if name not in models:
            raise ConfigError(
                f"model {name!r} is not served at {root} (it serves: {', '.join(models) or 'nothing'})",
                "give served names from GET /v1/models (an adapter's name for the LoRA)",
            )


async def collect_answers(
    config: EvalConfig,
    prompts: list[tuple[Messages, Messages]],
    tools: list[list[dict[str, Any]] | None] | None = None,
) -> list[tuple[Answer, Answer]]:
    """(baseline answer, candidate answer) per item, at most `concurrency` requests in
    flight; `tools[i]` (the item's functions, for tool-calling items) goes with both."""
    root = api_root(config.base_url)
    url = root + "/chat/completions"
    key = config.api_key.get_secret_value() if config.api_key else None
    gate = asyncio.Semaphore(config.concurrency)
    async with make_client(key, config.timeout_s, max_connections=config.concurrency) as client:
        await _check_models(client, root, config)
        tasks = []
        for i, (base_msgs, lora_msgs) in enumerate(prompts):
            fns = tools[i] if tools else None
            tasks.append(_ask(client, url, config.base_model, base_msgs, config, gate, fns))
            tasks.append(_ask(client, url, config.lora_model, lora_msgs, config, gate, fns))
        answers = await asyncio.gather(*tasks)
    return [(answers[i], answers[i + 1]) for i in range(0, len(answers), 2)]


def score_samples(
    test: TestSet,
    prompts: list[tuple[Messages, Messages]],
    answers: list[tuple[Answer, Answer]],
    scorers: list[NamedScorer],
) -> list[Sample]:
    """The scored samples: each answer gets every scorer's score against the item's reference
    (0 on every metric for a failed request)."""
    samples = []
    for i, (conv, (bp, lp), (ba, la)) in enumerate(zip(test.items, prompts, answers, strict=True)):
        _, reference = split_item(conv)
        for ans in (ba, la):
            # an answer that failed scores 0 on every metric (counted apart in the report)
            ans.scores = {s.name: (0.0 if ans.error else s(ans.output, reference)) for s in scorers}
        samples.append(
            Sample(
                index=i,
                reference=reference,
                baseline_prompt=bp,
                lora_prompt=lp,
                baseline=ba,
                lora=la,
            )
        )
    return samples


async def run_eval_async(
    config: EvalConfig,
    *,
    out_dir: Path,
    store: ArtifactStore | None = None,
    publish_as: str | None = None,
) -> EvalReport:
    """Run the whole evaluation; write it to `out_dir`; publish it as `publish_as` if given."""
    scorers = [build_scorer(s) for s in config.scorers]
    test = resolve_test_set(config.test, store)
    items = test.items[: config.limit] if config.limit else test.items
    test = test.model_copy(update={"items": items})
    evidence: TrainingEvidence | None = None
    if config.adapter:
        evidence = read_training_evidence(config.adapter, store)
    prompts = []
    for conv in items:
        prompt, _ = split_item(conv)
        prompts.append((baseline_prompt(prompt, config), prompt))
    start = time.monotonic()
    answers = await collect_answers(config, prompts, [conv.tool_dicts() for conv in items])
    elapsed = time.monotonic() - start
    samples = score_samples(test, prompts, answers, scorers)
    if all(s.baseline.error and s.lora.error for s in samples):
        raise EndpointError(
            f"every request failed, e.g.: {samples[0].baseline.error}",
            "check that the endpoint is up and serves both models",
        )
    results = _compare(samples, scorers, config)
    report = build_report(config, test, evidence, samples, results, elapsed_s=elapsed)
    write_report(report, samples, out_dir)
    if publish_as and store is not None:
        # not in the files: they are what was published
        report.published = _publish(
            store,
            report,
            out_dir=out_dir,
            name=publish_as,
            test=test,
            evidence=evidence,
            primary_metric=config.primary_metric,
        )
    return report


def _compare(
    samples: list[Sample], scorers: list[NamedScorer], config: EvalConfig
) -> dict[str, PairedResult]:
    """Each scorer's paired bootstrap of the LoRA's scores against the baseline's."""
    return {
        s.name: paired_bootstrap(
            [x.baseline.scores[s.name] for x in samples],
            [x.lora.scores[s.name] for x in samples],
            confidence=config.confidence,
            resamples=config.resamples,
            seed=config.seed,
        )
        for s in scorers
    }


def _publish(
    store: ArtifactStore,
    report: EvalReport,
    *,
    out_dir: Path,
    name: str,
    test: TestSet,
    evidence: TrainingEvidence | None,
    primary_metric: str | None,
) -> str:
    """Publish `out_dir` as the report artifact `name`, its test split and adapter as
    parents; returns its ref."""
    parents = [
        m.as_parent(role)
        for role, m in (
            ("test", test.manifest),
            ("adapter", evidence.manifest if evidence else None),
        )
        if m is not None
    ]
    manifest = store.publish(
        out_dir,
        kind="report",
        name=name,
        service="evaluation",
        parents=parents,
        config=report.config,
        metadata={
            "verdicts": {k: v.verdict for k, v in report.metrics.items()},
            "primary_metric": primary_metric,
            "n": report.n,
        },
    )
    return manifest.ref


def run_eval(
    config: EvalConfig,
    *,
    out_dir: Path,
    store: ArtifactStore | None = None,
    publish_as: str | None = None,
) -> EvalReport:
    """Blocking wrapper of `run_eval_async` (for the CLI and synchronous tests)."""
    return asyncio.run(run_eval_async(config, out_dir=out_dir, store=store, publish_as=publish_as))


def default_report_name(test_ref: str) -> str | None:
    """'<run>/test[:v]' -> '<run>/eval'; None when the test split is not a store ref."""
    name = test_ref.partition(":")[0]
    head, sep, tail = name.rpartition("/")
    return f"{head}/eval" if sep and tail == "test" and head else None
