"""The host record in bench.json: which CPU class a real-engine result was measured on."""
import json

import pytest

from kvgate.tools.bench import cli as bench_cli
from kvgate.tools.bench import host

# /proc/cpuinfo as the project's boxes print it (an AVX2 AMD, an AMX Xeon), flags shortened to what matters
AMD_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 avx f16c avx2 bmi2 vaes vpclmulqdq
processor\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 avx f16c avx2 bmi2 vaes vpclmulqdq
"""
XEON_AMX = """processor\t: 0
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: avx avx2 avx512f avx512bw avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
"""


@pytest.mark.parametrize("flags,level", [
    ("avx avx2", "avx2"),
    ("avx2 avx512f avx512bw", "avx512"),
    ("avx2 avx512f avx512_bf16", "avx512_bf16"),
    ("avx2 avx512f avx512_bf16 amx_bf16 amx_tile", "amx"),
    ("avx2 avx512f avx512_bf16 amx_tile", "avx512_bf16"),  # AMX without its bf16 unit is not the AMX class
    ("sse sse2 avx", "other"),
])
def test_matrix_isa_names_the_highest_level_covered(flags, level):
    assert host.matrix_isa(flags.split()) == level


def test_cpuinfo_gives_the_first_processors_model_and_flags():
    model, flags = host.parse_cpuinfo(AMD_AVX2)
    assert model == "AMD EPYC"
    assert flags[-3:] == ["bmi2", "vaes", "vpclmulqdq"]
    assert host.matrix_isa(host.parse_cpuinfo(XEON_AMX)[1]) == "amx"


def test_describe_reads_a_cpuinfo_file(tmp_path):
    p = tmp_path / "cpuinfo"
    p.write_text(XEON_AMX)
    d = host.describe(str(p))
    assert d["cpu"].startswith("Intel(R) Xeon(R)") and d["matrix_isa"] == "amx"
    assert d["cpus"] >= 1
    assert host.summary_line(d).startswith("host: Intel(R) Xeon(R) Processor, ")


def test_describe_without_cpuinfo_says_unknown(tmp_path):
    d = host.describe(str(tmp_path / "absent"))
    assert d["matrix_isa"] == "unknown"
    assert d["cpu"]  # platform's name, or "unknown": never empty


def test_bench_json_records_the_host(tmp_path, capsys):
    out = tmp_path / "out"
    rc = bench_cli.main(["--sessions", "2", "--turns", "2", "--first-prompt", "100", "--tool-result", "10",
                         "--output", "4", "--time-scale", "0.01", "--policies", "none",
                         "--out", str(out), "--no-progress", "--no-plots"])
    assert rc == 0
    data = json.loads((out / "bench.json").read_text())
    def steady(d):  # the load average moves between the run and now
        return {k: v for k, v in d.items() if k != "load_1m"}
    assert steady(data["host"]) == steady(host.describe())
    assert data["host"]["matrix_isa"] != ""
    assert "host: " in capsys.readouterr().out
