"""Packing (trainer.data.packing, batching.Plan with pack_to): rows hold whole samples within
the width, every sample once per epoch, the loss and LoRA gradients of a packed batch
equal those of its samples computed alone, and no token attends across a boundary."""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lorastack.store import open_store
from trainer.config import RunConfig, load_config
from trainer.data.batching import Plan, collate, collate_micro_batch, supervised_count
from trainer.data.masking import IGNORE
from trainer.data.packing import pack_rows
from trainer.data.samples import Sample
from trainer.model.modeling import batch_loss, load_model
from trainer.recipe import run_training
from trainer.settings import TrainerSettings

VOCAB = 96  # the tiny_llama fixture's vocabulary (conftest)


def long_tailed(n: int, seed: int, low: int = 3, high: int = 60) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(rng.lognormal(2.5, 0.8, n), low, high)]


def test_rows_hold_every_sample_once_within_the_width() -> None:
    lengths = long_tailed(500, 0)
    order = [int(i) for i in np.random.default_rng(1).permutation(500)]
    rows = pack_rows(order, lengths, 64)
    assert sorted(i for row in rows for i in row) == list(range(500))
    assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
    # best-fit decreasing: within a row of the lower bound, far from one sample a row
    assert len(rows) <= -(-sum(lengths) // 64) + 2
    assert pack_rows(order, lengths, 64) == rows  # a pure function
    with pytest.raises(ValueError, match="more than a row"):
        pack_rows([0], [65], 64)


def test_packed_plan_covers_each_epoch_and_keeps_its_step_count() -> None:
    lengths = long_tailed(200, 2)
    plan = Plan(3, lengths, micro_batch=2, grad_accum=3, pack_to=64)
    spe = plan.steps_per_epoch()
    assert spe < Plan(3, lengths, 2, 3).steps_per_epoch() / 2  # several samples a row
    for epoch in (0, 1):
        seen = [
            i
            for s in range(epoch * spe, (epoch + 1) * spe)
            for mb in plan.step(s)
            for r in mb
            for i in r
        ]
        assert sorted(seen) == list(range(200))
    assert plan.step(spe) != plan.step(0)  # another epoch, another order
    assert Plan(3, lengths, 2, 3, pack_to=64).step(spe + 1) == plan.step(spe + 1)


def sample(rng: np.random.Generator, length: int) -> Sample:
    ids = [int(x) for x in rng.integers(0, VOCAB, length)]
    labels = [t if k >= length // 2 else IGNORE for k, t in enumerate(ids)]
    return Sample(ids, labels, {}, "", [])


@pytest.fixture(scope="module")
def tiny(tiny_llama: Path) -> Any:
    config = RunConfig.model_validate(
        {"dataset": {"path": "unused.jsonl"}, "device": "cpu", "lora": {"dropout": 0.0}}
    )
    model = load_model(tiny_llama, config, torch.device("cpu"))
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    model.train()
    return model


def loss_and_grads(model: Any, batch: dict[str, torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = batch_loss(model, batch)
    loss.backward()
    return float(loss), [p.grad.clone() for p in model.parameters() if p.requires_grad]


def test_a_packed_batch_has_its_samples_loss_and_gradients(tiny: Any) -> None:
    rng = np.random.default_rng(4)
    samples = [sample(rng, n) for n in (17, 5, 30, 9, 22)]
    rows = [[samples[0], samples[1], samples[2]], [samples[3], samples[4]]]
    packed = collate_micro_batch(rows, pad_id=0, pack_to=64, fixed_rows=3)
    assert packed["input_ids"].shape == (3, 64) and "attention_mask" not in packed
    loss, grads = loss_and_grads(tiny, packed)
    alone = [loss_and_grads(tiny, collate([s], pad_id=0)) for s in samples]
    assert loss == pytest.approx(sum(a for a, _ in alone), rel=1e-5)
    for k, g in enumerate(grads):
        torch.testing.assert_close(g, sum(a[1][k] for a in alone), rtol=1e-4, atol=1e-6)
    # the supervised count the step divides by is the positions the packed loss counted
    assert supervised_count(samples) == int((packed["labels"][:, 1:] != IGNORE).sum())


def test_no_token_attends_across_a_sample_boundary(tiny: Any) -> None:
    rng = np.random.default_rng(5)
    first, second = sample(rng, 20), sample(rng, 25)
    changed = Sample([(t + 1) % VOCAB for t in first.input_ids], first.labels, {}, "", [])
    decoder = tiny.get_base_model().get_decoder()
    tiny.eval()
    with torch.no_grad():
        outs = []
        for head in (first, changed):
            batch = collate_micro_batch([[head, second]], 0, pack_to=48)
            hidden = decoder(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
            outs.append(hidden.last_hidden_state[0, 20:45])
        alone = decoder(input_ids=torch.tensor([second.input_ids])).last_hidden_state[0]
    tiny.train()
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)  # the second sample's states
    torch.testing.assert_close(outs[0], alone, rtol=1e-5, atol=1e-5)


def test_a_packed_run_resumes_exactly(
    trainer_env: TrainerSettings, demo_jsonl: Path, write_config: Callable[..., Path]
) -> None:
    """Stopped after its step-2 checkpoint and resumed, a packed run takes the batches the
    uninterrupted run took: the same losses, bit for bit, with several samples a row."""
    packed = {"packing": True, "max_steps": 4, "checkpoint_every": 2, "eval_every": 100}
    full = run_training(load_config(write_config("packed-full", demo_jsonl, **packed)), trainer_env)
    cut_cfg = load_config(write_config("packed-cut", demo_jsonl, **packed))
    run_training(cut_cfg, trainer_env)
    # as if killed before step 4's checkpoint: only step 2's remains
    run = trainer_env.resolved_runs_dir / "packed-cut"
    shutil.rmtree(run / "checkpoints" / "step-00000004")
    (run / "training-complete.json").unlink()
    open_store(trainer_env).delete("packed-cut/checkpoints", "4")
    resumed = run_training(cut_cfg, trainer_env, resume=True)
    assert list(full.losses) == [1, 2, 3, 4]
    assert resumed.losses == {3: full.losses[3], 4: full.losses[4]}  # float equality
    done = full.completion
    assert done["tokens"] > 2 * done["supervised_tokens"] > 0
    assert done["tokens_per_s"] == pytest.approx(done["tokens"] / done["wall_s"], abs=0.06)
    assert 0 < done["supervised_tokens_per_s"] < done["tokens_per_s"]
    assert done["nvml"] is None  # no GPU here; on one: used, total, utilisation, power
    parts = done["memory_parts"]  # each part of the estimate next to its measurement
    assert set(parts) == {"weights_and_adapter", "optimizer", "step", "total"}
    for part in ("weights_and_adapter", "optimizer"):  # tensors' bytes on the CPU: exact
        assert abs(parts[part]["error"]) < 0.01, parts
    assert parts["total"]["measured"] > parts["weights_and_adapter"]["measured"]


def test_sample_offsets_mark_every_sample_and_the_padding() -> None:
    rng = np.random.default_rng(6)
    rows = [[sample(rng, 5), sample(rng, 3)], [sample(rng, 8)]]
    batch = collate_micro_batch(rows, pad_id=0, pack_to=10)
    # row 0: samples of 5 and 3, then 2 padding tokens; row 1: 8, then 2 padding
    assert batch["cu_seq_lens"].tolist() == [0, 5, 8, 10, 18, 20]
    assert batch["cu_seq_lens"].dtype == torch.int32


def per_sample_attention(calls: list[int]) -> Callable[..., torch.Tensor]:
    """What FlashAttention's variable-length kernel computes, one sample at a time."""

    def attend(q: Any, k: Any, v: Any, cu: Any, width: int, scale: float) -> torch.Tensor:
        calls.append(width)
        bounds = cu.tolist()
        out = [
            torch.nn.functional.scaled_dot_product_attention(
                q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
                is_causal=True, scale=scale, enable_gqa=True,
            ).transpose(0, 1)
            for s, e in itertools.pairwise(bounds)
        ]  # fmt: skip
        return torch.cat(out)

    return attend


def test_variable_length_attention_gives_the_masked_result(
    tiny: Any, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loaded for variable-length attention (CUDA's choice for packed rows), the model
    hands each layer the samples' offsets and gets the loss and gradients of the dense
    block-diagonal mask; calls without offsets (evaluation) take SDPA's path."""
    from trainer.model import attention

    calls: list[int] = []
    monkeypatch.setattr(attention, "use_varlen", lambda *a: True)
    monkeypatch.setattr(attention, "flash_varlen", per_sample_attention(calls))
    config = RunConfig.model_validate(
        {"dataset": {"path": "unused.jsonl"}, "device": "cpu", "lora": {"dropout": 0.0}}
    )
    varlen = load_model(tiny_llama, config, torch.device("cpu"))
    assert varlen.config._attn_implementation == attention.VARLEN
    varlen.load_state_dict(tiny.state_dict())
    varlen.train()
    rng = np.random.default_rng(7)
    samples = [sample(rng, n) for n in (17, 5, 30, 9, 22)]
    batch = collate_micro_batch([samples[:3], samples[3:]], pad_id=0, pack_to=64)
    loss, grads = loss_and_grads(tiny, batch)
    loss_v, grads_v = loss_and_grads(varlen, batch)
    assert calls == [64, 64]  # each of the two layers, the row width as the longest bound
    assert loss_v == pytest.approx(loss, rel=1e-5)
    for g, gv in zip(grads, grads_v, strict=True):
        torch.testing.assert_close(gv, g, rtol=1e-4, atol=1e-6)
    batch.pop("cu_seq_lens")  # without offsets: SDPA and the mask transformers built
    assert loss_and_grads(varlen, batch)[0] == pytest.approx(loss, rel=1e-5)
    assert len(calls) == 2


def test_variable_length_rows_need_no_mask_unless_a_layer_can_fall_back() -> None:
    """transformers' mask for packed rows waits for the GPU and is never read by the
    variable-length kernel: an empty stand-in skips it, unless some layer of the model
    can fall back to SDPA (sliding windows, dropout), which then needs the real mask."""
    from types import SimpleNamespace

    from trainer.model import attention

    cu = torch.tensor([0, 5, 9], dtype=torch.int32)

    def kwargs(**config: Any) -> dict[str, Any]:
        model = SimpleNamespace(
            config=SimpleNamespace(_attn_implementation=attention.VARLEN, **config)
        )
        return attention.model_kwargs(model, cu, 9)

    assert kwargs()["attention_mask"].shape == (0, 0, 0, 0)
    assert kwargs(layer_types=["full_attention"] * 2)["attention_mask"].numel() == 0
    for config in ({"sliding_window": 4096}, {"attention_dropout": 0.1},
                   {"layer_types": ["sliding_attention", "full_attention"]}):  # fmt: skip
        assert "attention_mask" not in kwargs(**config)
    q = torch.zeros(1, 2, 9, 8)
    with pytest.raises(RuntimeError, match="without their mask"):
        attention.varlen_attention(
            torch.nn.Module(), q, q, q, kwargs()["attention_mask"], cu_seq_lens_q=cu,
            sliding_window=4,
        )  # fmt: skip


@pytest.mark.gpu
def test_flash_varlen_matches_sdpa_on_cuda() -> None:
    """The real kernel (CUDA only) against SDPA with the dense mask, grouped-query heads."""
    from trainer.model import attention

    torch.manual_seed(0)
    lengths, heads, kv, d = [300, 5, 700, 1043], 8, 2, 64
    total = sum(lengths)
    q, k, v = (
        torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for h in (heads, kv, kv)
    )
    cu = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32, device="cuda")
    out = attention.flash_varlen(q, k, v, cu, 2048, d**-0.5)
    ref = per_sample_attention([])(q, k, v, cu, 2048, d**-0.5)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    out.float().square().sum().backward()
    dq = q.grad.clone()
    q.grad = None
    ref.float().square().sum().backward()
    torch.testing.assert_close(dq, q.grad, rtol=5e-2, atol=5e-2)
