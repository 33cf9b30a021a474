"""The load tester against the scripted fake upstream: known TTFT (200 ms) and
inter-token gaps (20 ms) per answer.

No wall-clock window: a loaded machine only ever adds time, so what holds there too is
asserted. The fake never sends a token before its time (token i at TTFT + i x ITL after it
took the request), so every TTFT is at least 200 ms and every E2E at least 500 ms; a
level of n requests, each at least E2E long and at most c at once, lasts at least
n x E2E / c, so its throughput is at most c x OUT / E2E. TPOT and ITL have no such bound
(a first chunk read late shortens E2E - TTFT), so they are held to their definitions
over the recorded chunk times, and to the counts. Their values against vLLM's own
benchmark on an idle machine: bench/loadtest/."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest

from evaluation.loadtest_config import LoadtestConfig
from evaluation.loadtest_report import PNG, render_markdown, render_text, write_outputs
from evaluation.loadtest_run import run_loadtest
from evaluation.loadtest_stats import LevelResult, RequestRecord
from lorastack.cli import main as cli_main
from lorastack_testing.fake_vllm import FakeServer, echo_answer

TTFT = 0.200  # seconds, scripted
ITL = 0.020  # seconds, scripted
OUT = 16  # tokens per answer
E2E = TTFT + (OUT - 1) * ITL  # 0.5 s


def check_timings(
    level: LevelResult, records: list[RequestRecord], *, ttft: float, e2e: float, out: int
) -> None:
    """What a level's figures must be whatever the load: each request no faster than the
    fake's script (`ttft`, `e2e`: seconds), its `out` chunks timed in order, TPOT and ITL
    as defined over them, and throughput as the token total over the level's duration."""
    assert level.completed == len(records) and level.errors == 0
    for rec in records:
        assert rec.ttft_s is not None and rec.e2e_s is not None, rec
        assert rec.ttft_s >= ttft and rec.e2e_s >= e2e, rec  # never faster than the script
        times = rec.chunk_times_s
        assert len(times) == out and times == sorted(times), rec
        assert (times[0], times[-1]) == (rec.ttft_s, rec.e2e_s)
        assert rec.tpot_s == (rec.e2e_s - rec.ttft_s) / (out - 1)
        assert sum(rec.itls_s) == pytest.approx(rec.e2e_s - rec.ttft_s)
        assert level.duration_s >= rec.sent_s + rec.e2e_s  # first send -> last finish
    tpots = [rec.tpot_s * 1000 for rec in records if rec.tpot_s is not None]
    assert level.tpot_ms.n == len(records) and level.tpot_ms.p50 == pytest.approx(
        statistics.median(tpots)
    )
    assert level.itl_ms.n == len(records) * (out - 1)  # every gap between `out` chunks
    assert level.ttft_ms.p50 is not None and level.ttft_ms.p50 >= ttft * 1000
    assert level.e2e_ms.p50 is not None and level.e2e_ms.p50 >= e2e * 1000
    assert level.output_tokens == len(records) * out
    assert level.output_tokens_per_s == pytest.approx(level.output_tokens / level.duration_s)


def at_most(in_flight: int, out: int, e2e: float) -> float:
    """The highest output tokens/s a level can show: `in_flight` requests at once, each
    `out` tokens in no less than `e2e` seconds (a float's rounding aside)."""
    return in_flight * out / e2e * (1 + 1e-9)


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
    for r, records in zip(result.levels, result.records, strict=True):
        assert r.requests == 4
        check_timings(r, records, ttft=TTFT, e2e=E2E, out=OUT)
        assert r.token_sources == {"usage": 4}
        # goodput counts exactly the requests within both SLOs, whatever their timings
        good = [
            rec for rec in records
            if (rec.ttft_s or 0) * 1000 <= 300 and (rec.tpot_s or 0) * 1000 <= 30
        ]  # fmt: skip
        assert r.good_fraction == len(good) / 4
        assert r.goodput_rps == pytest.approx(len(good) / r.duration_s)
    # throughput: c requests in flight, each OUT tokens in no less than E2E seconds
    assert c1.output_tokens_per_s <= at_most(1, OUT, E2E)
    assert c4.output_tokens_per_s <= at_most(4, OUT, E2E)
    assert c4.requests_per_s <= at_most(4, 1, E2E)
    # the server's /metrics, sampled during the level: never more running than sent
    assert c4.server is not None and c1.server is not None
    assert c4.server.peak_kv_cache_usage is not None and c1.server.peak_kv_cache_usage is not None
    assert c4.server.peak_kv_cache_usage <= 0.4 + 1e-9  # 4 running x 0.1
    assert c1.server.peak_kv_cache_usage <= 0.1 + 1e-9
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


def test_queueing_at_the_server_bounds_the_level(tmp_path: Path) -> None:
    answer = 0.1 + 9 * 0.01  # seconds a request holds one of the fake's 2 running slots
    with FakeServer(**_script(0.1, 0.01, max_running=2)) as f:
        cfg = _cfg(f, concurrency=[4], requests=8, output_len=10)
        result = run_loadtest(cfg, log=lambda s: None)
        queued = f.state.waited
    (r,), (records,) = result.levels, result.records
    check_timings(r, records, ttft=0.1, e2e=answer, out=10)
    # 8 answers through 2 slots: the level lasts at least 4 answers, however it was sent
    assert r.duration_s >= 8 * answer / 2
    assert r.server is not None and r.server.peak_running is not None
    assert r.server.peak_running <= 2 and (r.server.peak_waiting or 0) <= 4 - 2
    # 4 streams kept in flight against 2 slots: some wait at the fake (none would only
    # if the client stalled a whole answer long before every send)
    assert queued >= 1


def test_poisson_rate_level_and_errors(tmp_path: Path) -> None:
    with FakeServer(**_script(0.05, 0.005, fail_every=4, send_usage=False)) as f:
        cfg = _cfg(f, rates=[20.0], requests=12, output_len=8, seed=3)
        (r,) = run_loadtest(cfg, log=lambda s: None).levels
    assert r.level.label == "20 req/s"
    assert r.requests == 12 and r.errors == 3 and r.completed == 9
    assert "HTTP 500" in r.error_examples[0]
    assert r.token_sources == {"chunks": 9}  # no usage field, no tokenizer: chunks counted
    assert r.output_tokens == 9 * 8


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
        assert r.requests == 6
        check_timings(r, records, ttft=TTFT, e2e=E2E, out=OUT)
        assert [rec.index for rec in records] == list(range(6))
        assert r.client_busy is not None and r.client_busy >= 0
    # 3 in flight, never more: by the fake's /metrics and by the level's throughput
    assert c3.server is not None and c3.server.peak_kv_cache_usage is not None
    assert c3.server.peak_kv_cache_usage <= 0.3 + 1e-9
    assert c3.output_tokens_per_s <= at_most(3, OUT, E2E)
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
