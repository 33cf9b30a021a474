"""The load tester against the scripted fake upstream: known TTFT (200 ms) and
inter-token gaps (20 ms), so every measured figure has a known true value.

Tolerances (loopback HTTP, a busy 2-core CI machine): TTFT and E2E +-25% (each adds a
few ms of client/server overhead), TPOT and ITL medians +-25%, throughput +-30%."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from evaluation.loadtest_config import LoadtestConfig
from evaluation.loadtest_report import PNG, render_markdown, render_text, write_outputs
from evaluation.loadtest_run import run_loadtest
from lorastack.cli import main as cli_main
from lorastack_testing.fake_vllm import FakeServer, echo_answer

TTFT = 0.200  # seconds, scripted
ITL = 0.020  # seconds, scripted
OUT = 16  # tokens per answer
E2E = TTFT + (OUT - 1) * ITL  # 0.5 s


def near(measured: float | None, true: float, rel: float) -> bool:
    return measured is not None and abs(measured - true) <= rel * true


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeServer]:
    with FakeServer(**_script(TTFT, ITL)) as f:
        yield f


def _script(ttft_s: float, itl_s: float, **more: object) -> dict[str, object]:
    """The fake vLLM answering with the prompt's words on a set schedule, model "m", and
    0.1 of KV cache per running request."""
    return {"ttft_s": ttft_s, "pace_s": itl_s, "models": [{"id": "m"}], "answer": echo_answer,
            "prompt_tokens": None, "kv_per_request": 0.1} | more  # fmt: skip


def _cfg(fake: FakeServer, **kw: object) -> LoadtestConfig:
    base = {"base_url": fake.base_url, "model": "m", "output_len": OUT, "input_len": 8, "warmup": 0,
            "metrics_url": fake.base_url + "/metrics", "metrics_interval_s": 0.05}  # fmt: skip
    return LoadtestConfig.model_validate(base | kw)


def test_concurrency_levels_match_the_script(fake: FakeServer, tmp_path: Path) -> None:
    cfg = _cfg(fake, concurrency=[1, 4], requests=4, slo_ttft_ms=300, slo_tpot_ms=30)
    result = run_loadtest(cfg, log=lambda s: None)
    c1, c4 = result.levels
    for r in (c1, c4):
        assert r.completed == 4 and r.errors == 0
        assert near(r.ttft_ms.p50, TTFT * 1000, 0.25), r.ttft_ms
        assert near(r.tpot_ms.p50, ITL * 1000, 0.25), r.tpot_ms
        assert near(r.itl_ms.p50, ITL * 1000, 0.25), r.itl_ms
        assert near(r.e2e_ms.p50, E2E * 1000, 0.25), r.e2e_ms
        assert (
            r.ttft_ms.p50 is not None and r.ttft_ms.p50 >= TTFT * 1000
        )  # never faster than the script
        assert r.itl_ms.n == 4 * (OUT - 1)  # every gap between 16 chunks
        assert r.token_sources == {"usage": 4} and r.output_tokens == 4 * OUT
        assert r.goodput_rps is not None and r.good_fraction == 1.0
    # throughput: c requests in flight, each OUT tokens per E2E seconds
    assert near(c1.output_tokens_per_s, OUT / E2E, 0.3)
    assert near(c4.output_tokens_per_s, 4 * OUT / E2E, 0.3)
    assert near(c4.requests_per_s, 4 / E2E, 0.3)
    assert c4.server is not None and c1.server is not None
    assert c4.server.peak_kv_cache_usage == pytest.approx(0.4)  # 4 running x 0.1
    assert c1.server.peak_kv_cache_usage == pytest.approx(0.1)
    assert c4.server.peak_waiting == 0 and c4.server.preemptions == 0
    # every request asked for a fixed length, streamed, with usage
    body = fake.requests[-1]
    assert body["max_tokens"] == OUT and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}

    out = tmp_path / "lt"
    write_outputs(result, out)
    data = json.loads((out / "report.json").read_text())
    assert [lv["level"]["value"] for lv in data["levels"]] == [1, 4]
    assert "TPOT" in data["formulas"]
    assert len((out / "samples.jsonl").read_text().splitlines()) == 8
    assert (out / PNG).read_bytes()[:4] == b"\x89PNG"
    md = render_markdown(result)
    assert "(E2E - TTFT) / (output tokens - 1)" in md and "| c=4 |" in md
    assert "APPROXIMATELY" in render_text(result)  # no tokenizer: lengths are approximate


def test_queueing_shows_in_ttft_and_waiting(tmp_path: Path) -> None:
    with FakeServer(**_script(0.1, 0.01, max_running=2)) as f:
        cfg = _cfg(f, concurrency=[4], requests=8, output_len=10, slo_ttft_ms=150)
        (r,) = run_loadtest(cfg, log=lambda s: None).levels
    assert r.server is not None and r.server.peak_waiting == 2 and r.server.peak_running == 2
    # half the requests wait one full answer (0.1 + 9 x 0.01 s) before their TTFT starts
    assert r.ttft_ms.p90 is not None and r.ttft_ms.p90 > 250
    assert r.good_fraction is not None and 0.25 <= r.good_fraction <= 0.75


def test_poisson_rate_level_and_errors(tmp_path: Path) -> None:
    with FakeServer(**_script(0.05, 0.005, fail_every=4, send_usage=False)) as f:
        cfg = _cfg(f, rates=[20.0], requests=12, output_len=8, seed=3)
        (r,) = run_loadtest(cfg, log=lambda s: None).levels
    assert r.level.label == "20 req/s"
    assert r.requests == 12 and r.errors == 3 and r.completed == 9
    assert "HTTP 500" in r.error_examples[0]
    assert r.token_sources == {"chunks": 9}  # no usage field, no tokenizer: chunks counted
    assert r.output_tokens == 9 * 8
    # 12 arrivals at 20/s take ~0.55 s on average; the level ends after the last answer
    assert 0.2 < r.duration_s < 2.5


def test_completions_endpoint(fake: FakeServer) -> None:
    cfg = _cfg(fake, endpoint="completions", concurrency=[2], requests=2, output_len=4)
    (r,) = run_loadtest(cfg, log=lambda s: None).levels
    assert r.completed == 2 and r.output_tokens == 8
    assert "prompt" in fake.requests[-1] and "messages" not in fake.requests[-1]


def test_cli_loadtest_and_errors(
    fake: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        '{"prompt": "hello there"}\n{"messages": [{"role": "user", "content": "hi"}]}\n'
    )
    out = tmp_path / "out"
    code = cli_main(["loadtest", "--base-url", fake.base_url, "--model", "m", "--concurrency", "2",
                     "--requests", "2", "--output-len", "3", "--prompts", str(prompts),
                     "--warmup", "0", "--out", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0 and "TTFT ms p50/p90/p99" in text and "TPOT      = (E2E - TTFT)" in text
    assert (out / "report.json").is_file()
    code = cli_main(["loadtest", "--base-url", fake.base_url, "--model", "m", "--out", str(out)])
    assert code == 2 and "give --concurrency levels" in capsys.readouterr().err
    code = cli_main(["loadtest", "--base-url", fake.base_url, "--model", "nope", "--concurrency", "1",
                     "--out", str(out)])  # fmt: skip
    assert code == 2 and "does not exist" in capsys.readouterr().err


def test_cli_bad_levels_name_what_to_give(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli_main(["loadtest", "--base-url", "http://127.0.0.1:9", "--model", "m",
                     "--requests", "0", "--out", str(tmp_path / "out")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert "invalid load test: requests: Input should be greater than or equal to 1" in err
    code = cli_main(["loadtest", "--base-url", "http://127.0.0.1:9", "--model", "m",
                     "--out", str(tmp_path / "out")])  # fmt: skip
    assert code == 2
    assert "invalid load test: flags: give --concurrency levels and/or --rate levels" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "out").exists()


def test_levels_spread_over_client_processes(fake: FakeServer) -> None:
    """Two client processes send each level from one start: 3 streams as 2 + 1, the rate
    level's arrivals alternating; every request once, the figures those of one process."""
    cfg = _cfg(fake, concurrency=[3], rates=[20.0], requests=6, processes=2)
    result = run_loadtest(cfg, log=lambda s: None)
    c3, rate = result.levels
    for r, records in zip(result.levels, result.records, strict=True):
        assert r.completed == 6 and r.errors == 0 and r.output_tokens == 6 * OUT
        assert near(r.ttft_ms.p50, TTFT * 1000, 0.25), r.ttft_ms
        assert near(r.tpot_ms.p50, ITL * 1000, 0.25), r.tpot_ms
        assert [rec.index for rec in records] == list(range(6))
        assert r.client_busy is not None and r.client_busy >= 0
    assert c3.server is not None and c3.server.peak_kv_cache_usage == pytest.approx(0.3)
    assert near(c3.output_tokens_per_s, 3 * OUT / E2E, 0.3)  # 3 in flight, never more
    assert rate.level.label == "20 req/s"


def test_a_busy_client_is_named_in_the_notes(fake: FakeServer) -> None:
    from evaluation.loadtest_run import CLIENT_BUSY, _notes
    from evaluation.loadtest_stats import Level, summarise_level

    cfg = _cfg(fake, concurrency=[64], processes=2)
    level = summarise_level(Level(kind="concurrency", value=64), [], 1.0, client_busy=0.97)
    (note,) = [n for n in _notes(cfg, [level]) if "load generator" in n]
    assert "busy 97% of a core at level c=64" in note and "--processes 4" in note
    calm = summarise_level(Level(kind="concurrency", value=1), [], 1.0, client_busy=CLIENT_BUSY / 2)
    assert not [n for n in _notes(cfg, [calm]) if "load generator" in n]
