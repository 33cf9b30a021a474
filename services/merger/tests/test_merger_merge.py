"""Merging real peft adapters into SmolLM2-135M on CPU: verified, refused or failed."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from lorastack.cli import main
from lorastack.errors import Refused
from lorastack.manifest import Manifest
from lorastack.store import open_store
from merger.cli import print_report
from merger.merge import merge_adapter
from merger.settings import MergerSettings

AdapterFactory = Callable[..., Manifest]  # the make_adapter fixture (conftest.py)


@pytest.mark.slow
def test_float32_merge_verifies_and_publishes(
    make_adapter: AdapterFactory,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Through the CLI, as a user runs it (the SmolLM2 base is float32: so is the default)."""
    adapter = make_adapter(target_modules="all-linear")
    monkeypatch.setenv("LORASTACK_MERGE_PROBE_NEW_TOKENS", "8")
    monkeypatch.setenv("LORASTACK_TORCH_THREADS", "2")
    assert main(["merge", adapter.ref, "--probes", "2"]) == 0
    out = capsys.readouterr().out
    assert "published run1/merged:1" in out
    with capsys.disabled():
        print("\n" + out)  # the verification table, shown with pytest -s

    store = open_store(MergerSettings())
    merged = store.resolve("run1/merged")
    assert merged.kind == "merged-model"
    assert {p.role: p.digest for p in merged.parents} == {
        "base": store.resolve("smollm2-135m-instruct").digest,
        "adapter": adapter.digest,
    }
    folder = store.fetch(merged)
    files = {f.path for f in merged.files}
    assert {"merge-report.json", "README.md", "chat_template.jinja", "tokenizer.json"} <= files
    assert [p.name for p in folder.glob("*.safetensors")] == ["model.safetensors"]  # as the base

    report = json.loads((folder / "merge-report.json").read_text())
    assert report["passed"] and report["dtype"] == "float32"
    assert report["merged"]["max_abs_logit_diff"] < 1e-2
    assert report["merged"]["top1_agreement"] == 1.0
    assert report["merged"]["greedy_identical"] == report["merged"]["greedy_probes"] == 2
    assert report["adapter_effect"]["max_abs_logit_diff"] > 0.1  # the merge was not a no-op
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"
    gen = json.loads((folder / "generation_config.json").read_text())
    assert 2 in gen["eos_token_id"]  # <|im_end|>, ChatML's end of turn
    card = (folder / "README.md").read_text()
    assert adapter.digest in card and "run1/data:1" in card and "run config" in card

    # the same adapter and settings again: the verified merge is kept, nothing republished
    assert main(["merge", adapter.ref, "--probes", "2"]) == 0
    assert "already merged with these settings: run1/merged:1" in capsys.readouterr().out
    assert store.versions("run1/merged") == ["1"]


@pytest.mark.slow
def test_bfloat16_merge_reports_numbers_against_thresholds(
    settings: MergerSettings, make_adapter: AdapterFactory
) -> None:
    adapter = make_adapter()  # q, k, v, o
    result = merge_adapter(settings, adapter.ref, dtype="bfloat16", probes=2)
    r = result.report
    for key in ("merged", "dtype_only", "merge_only"):
        assert r[key]["positions"] > 0 and r[key]["greedy_probes"] == 2
    assert r["thresholds"]["max_abs_logit"] == 8.0 and r["thresholds"]["max_ratio_to_dtype"] == 2.0
    # bf16 moves logits by whole units; the merge must add no more than the dtype does.
    assert r["dtype_only"]["max_abs_logit_diff"] > 0.05
    assert r["merged"]["max_abs_logit_diff"] <= 2 * r["dtype_only"]["max_abs_logit_diff"]
    assert r["passed"] and result.manifest is not None
    assert json.loads((result.folder / "config.json").read_text())["dtype"] == "bfloat16"
    print_report(r)  # shown with pytest -s


@pytest.mark.slow
def test_failed_verification_publishes_nothing(
    settings: MergerSettings, make_adapter: AdapterFactory
) -> None:
    """LoRA on lm_head of a model with tied embeddings: merging it also rewrites the
    input embeddings, so the merged model is not base + adapter. Verification sees it."""
    adapter = make_adapter(target_modules=["q_proj", "lm_head"], scale=0.05)
    result = merge_adapter(settings, adapter.ref, probes=2)
    assert result.manifest is None and not result.report["passed"]
    assert any("max |Δlogit|" in f for f in result.report["failures"])
    assert result.report["advice"]
    assert (result.folder / "merge-report.json").is_file()
    assert open_store(settings).ls("run1/merged") == []


def test_quantized_base_is_refused(
    settings: MergerSettings, make_adapter: AdapterFactory, embedded_model: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "nf4-base"
    folder.mkdir()
    for f in embedded_model.iterdir():
        if f.suffix == ".safetensors":
            (folder / f.name).symlink_to(f)  # 538 MB: link it, nothing writes it
        else:
            shutil.copy(f, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_compute_dtype": "float32",
    }
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(config))
    store = open_store(settings)
    base = store.publish(folder, kind="base-model", name="smollm2-nf4", service="test")
    adapter = make_adapter(base=base.as_parent("base"))
    with pytest.raises(Refused) as e:
        merge_adapter(settings, adapter.ref, probes=1)
    assert "quantized" in e.value.message and "4-bit (nf4)" in e.value.message
    assert "unquantised" in e.value.hint and "rounded away" in e.value.hint
    assert store.ls("run1/merged") == []


def test_base_with_another_digest_is_refused(
    settings: MergerSettings, make_adapter: AdapterFactory, base_manifest: Manifest
) -> None:
    trained_on = base_manifest.as_parent("base").model_copy(
        update={"digest": "sha256:" + "ab" * 32}
    )
    adapter = make_adapter(base=trained_on)
    with pytest.raises(Refused) as e:
        merge_adapter(settings, adapter.ref, probes=1)
    assert base_manifest.digest in e.value.message and trained_on.digest in e.value.message
