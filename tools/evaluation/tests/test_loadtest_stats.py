"""Pure load-test arithmetic: TPOT, ITL, percentiles, goodput, Prometheus parsing."""

from __future__ import annotations

import pytest

from evaluation.loadtest_stats import Level, RequestRecord, percentiles, summarise_level
from evaluation.prom import parse_prometheus, summarise_samples


def _rec(i: int, ttft: float, gaps: list[float], tokens: int | None = None) -> RequestRecord:
    times = [ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestRecord(index=i, sent_s=0.0, ttft_s=ttft, e2e_s=times[-1], chunk_times_s=times,
                         output_tokens=tokens or len(times), token_source="usage")  # fmt: skip


def test_tpot_uses_output_tokens_not_chunks() -> None:
    # 3 chunks but 5 tokens (chunks may carry several tokens): TPOT = (E2E - TTFT) / 4
    r = _rec(0, 0.5, [0.2, 0.2], tokens=5)
    assert r.tpot_s == pytest.approx(0.4 / 4)
    assert r.itls_s == pytest.approx([0.2, 0.2])
    assert _rec(1, 0.5, [], tokens=1).tpot_s is None


def test_summary_figures() -> None:
    recs = [_rec(i, 0.1 * (i + 1), [0.01] * 9) for i in range(4)]  # 10 tokens each
    recs.append(RequestRecord(index=4, sent_s=0.0, error="HTTP 503: busy"))
    r = summarise_level(Level(kind="concurrency", value=2), recs, duration_s=2.0,
                        slo_ttft_ms=250, slo_tpot_ms=20)  # fmt: skip
    assert (r.requests, r.completed, r.errors) == (5, 4, 1)
    assert r.ttft_ms.p50 == pytest.approx(250.0)  # median of 100..400 ms
    assert r.tpot_ms.p50 == pytest.approx(10.0)
    assert r.e2e_ms.p50 == pytest.approx(250.0 + 90.0)
    assert r.output_tokens == 40 and r.output_tokens_per_s == pytest.approx(20.0)
    assert r.requests_per_s == pytest.approx(2.0)
    assert r.goodput_rps == pytest.approx(1.0)  # TTFT 100 and 200 ms pass, 300 and 400 fail
    assert r.good_fraction == pytest.approx(2 / 5)
    assert r.error_examples == ["HTTP 503: busy"]


def test_percentiles_match_numpy_linear() -> None:
    p = percentiles([1.0, 2.0, 3.0, 4.0, 100.0])
    assert (p.p50, p.p90, p.mean) == (3.0, pytest.approx(61.6), 22.0)
    assert percentiles([]).p50 is None


PROM = """# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="a"} 0.5
vllm:num_requests_waiting{engine="0",model_name="a"} 2.0
vllm:num_requests_waiting{engine="1",model_name="a"} 1.0
vllm:num_preemptions_total{engine="0",model_name="a"} 7.0
vllm:cache_config_info{block_size="128",label="a b"} 1.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="a"} 3.0
weird line
"""


def test_prometheus_parsing_and_peaks() -> None:
    s = parse_prometheus(PROM)
    assert s["vllm:kv_cache_usage_perc"] == [0.25, 0.5]
    assert s["vllm:cache_config_info"] == [1.0]
    later = parse_prometheus(PROM.replace(" 7.0", " 10.0").replace(" 0.5\n", " 0.75\n"))
    old_style = {"vllm:gpu_cache_usage_perc": [0.9]}
    peaks = summarise_samples([s, later])
    assert peaks.peak_kv_cache_usage == 0.75
    assert peaks.peak_waiting == 3.0  # summed over engines
    assert peaks.preemptions == 3.0
    assert summarise_samples([old_style]).peak_kv_cache_usage == 0.9
    assert summarise_samples([]).preemptions is None


def test_split_level_cuts_streams_requests_and_arrivals() -> None:
    from evaluation.loadtest_clients import split_level

    payloads = [{"i": i} for i in range(10)]
    shares = split_level(Level(kind="concurrency", value=5), payloads, 2)
    assert [s.in_flight for s in shares] == [3, 2]  # 5 streams as 3 + 2
    assert [s.indices for s in shares] == [list(range(6)), list(range(6, 10))]  # 10 as 6 + 4
    assert [p["i"] for s in shares for p in s.payloads] == list(range(10))
    assert all(s.arrivals is None for s in shares)
    # more processes than streams: one stream each; fewer requests than streams: no empty share
    assert [s.in_flight for s in split_level(Level(kind="concurrency", value=2), payloads, 8)] == [
        1,
        1,
    ]
    few = split_level(Level(kind="concurrency", value=4), payloads[:2], 4)
    assert [s.indices for s in few] == [[0], [1]]
    # rate: request i to share i mod p at its own arrival time; the cap split like streams
    at = [0.1 * i for i in range(10)]
    rate = split_level(Level(kind="rate", value=10), payloads, 3, arrivals=at, max_concurrency=4)
    assert [s.indices for s in rate] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert rate[1].arrivals == [at[1], at[4], at[7]] and [s.in_flight for s in rate] == [2, 1, 1]
    uncapped = split_level(Level(kind="rate", value=10), payloads, 2, arrivals=at)
    assert [s.in_flight for s in uncapped] == [10, 10]
