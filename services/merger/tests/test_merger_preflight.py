"""The preflight: a merge that cannot fit is refused before any work, with the numbers
and what helps; free figures are injected where the machine's would be read."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from lorastack.errors import Refused
from lorastack.manifest import Manifest
from lorastack.store import open_store
from merger.merge import merge_adapter
from merger.preflight import DISK_MARGIN, GB, Have, Need, Sizes, check_fit, need_for
from merger.settings import MergerSettings

AdapterFactory = Callable[..., Manifest]


def test_a_merge_that_cannot_fit_the_disk_is_refused_before_any_work(
    settings: MergerSettings, make_adapter: AdapterFactory
) -> None:
    adapter = make_adapter()
    asked: list[Need] = []

    def small_disk(need: Need, device: str) -> Have:
        asked.append(need)
        return Have({f: 100 << 20 for f in need.disk}, host_ram=1 << 40, gpu_mem=None)

    with pytest.raises(Refused) as e:
        merge_adapter(settings, adapter.ref, probes=1, device="cpu", resources=small_disk)
    # SmolLM2-135M in float32: 134,515,008 parameters x 4 bytes written into the merge
    # folder; the file:// store on the same disk hard-links the shards in (publish's
    # hand_over), so it adds only the small files' margin, not a second copy
    (folder, needed), = asked[0].disk.items()  # fmt: skip
    assert needed == 134_515_008 * 4 + 2 * DISK_MARGIN
    assert f"disk: needs {needed / GB:.1f} GB under {folder}, free 0.1 GB" in e.value.message
    assert "LORASTACK_MERGE_DIR" in e.value.hint and "--dtype bfloat16" in e.value.hint
    assert not settings.resolved_merge_dir.exists()  # nothing written
    assert open_store(settings).ls("run1/merged") == []


def test_memory_shortfalls_name_the_numbers_and_the_way_out(tmp_path: Path) -> None:
    sizes = Sizes(output=16 * 10**9, largest_shard=5 * 10**9, adapter=10**8, params=8 * 10**9)
    gpu = need_for(sizes, tmp_path / "merges", None, on_gpu=True)
    assert gpu.host_ram == 5 * 10**9 + 10**8  # one shard + the adapter, not the model
    assert gpu.gpu_mem > 32 * 10**9  # the float32 model for verification
    roomy = Have({tmp_path / "merges": 10**12}, host_ram=64 * 10**9, gpu_mem=80 * 10**9)
    check_fit(gpu, roomy, "bfloat16", on_gpu=True)
    small_gpu = Have({tmp_path / "merges": 10**12}, host_ram=64 * 10**9, gpu_mem=24 * 10**9)
    with pytest.raises(Refused) as e:
        check_fit(gpu, small_gpu, "bfloat16", on_gpu=True)
    assert "GPU memory: needs 34.3 GB" in e.value.message and "--device cpu" in e.value.hint
    cpu = need_for(sizes, tmp_path / "merges", None, on_gpu=False)
    small_host = Have({tmp_path / "merges": 10**12}, host_ram=16 * 10**9, gpu_mem=None)
    with pytest.raises(Refused) as e:
        check_fit(cpu, small_host, "bfloat16", on_gpu=False)
    # on the CPU verification holds the float32 model in host memory: 32 + 5.1 + 0.2 GB
    assert "host memory: needs 37.3 GB, available 16.0 GB" in e.value.message
    assert "--device cuda" in e.value.hint


def test_a_store_on_another_file_system_needs_a_copy_of_the_output(tmp_path: Path) -> None:
    sizes = Sizes(output=16 * 10**9, largest_shard=5 * 10**9, adapter=10**8, params=8 * 10**9)
    store, merges = tmp_path / "store", tmp_path / "merges"
    copied = need_for(sizes, merges, store, on_gpu=True, linked=False)
    assert copied.disk == {merges: 16 * 10**9 + DISK_MARGIN, store: 16 * 10**9 + DISK_MARGIN}
    linked = need_for(sizes, merges, store, on_gpu=True, linked=True)
    assert linked.disk == {merges: 16 * 10**9 + DISK_MARGIN, store: DISK_MARGIN}
