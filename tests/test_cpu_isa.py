"""`benchmarks/real_vllm.py --cpu-isa`: a vLLM server that sees this CPU as an older one.

The shim (benchmarks/cpu_isa/sitecustomize.py) hides capabilities from `torch.cpu`, through which
vLLM picks its kernels; the fast tests check it against a stand-in `torch` package, the
vllm-marked one against the real PyTorch of the vLLM venv (docs/benchmarks.md#cpu-isa).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "benchmarks" / "cpu_isa"

# what the shim must change: module-level get_capabilities, read by the _is_*_supported helpers
FAKE_TORCH_CPU = '''
from types import MappingProxyType
CAPS = {"amx_tile": True, "amx_bf16": True, "avx512_f": True, "avx512_bf16": True,
        "avx2": True, "num_logical_cores": 2, "cpu_name": "Fake"}
def get_capabilities():
    return MappingProxyType(CAPS)
def _is_amx_tile_supported():
    return get_capabilities().get("amx_tile", False)
def _is_avx512_supported():
    return get_capabilities().get("avx512_f", False)
def _is_avx512_bf16_supported():
    return get_capabilities().get("avx512_bf16", False)
'''

PROBE = ("import json, torch.cpu as c; caps = c.get_capabilities(); "
         "print(json.dumps([c._is_amx_tile_supported(), c._is_avx512_supported(), "
         "c._is_avx512_bf16_supported(), caps['avx2'], caps['num_logical_cores']]))")


def _real_vllm_module():
    spec = importlib.util.spec_from_file_location("real_vllm", ROOT / "benchmarks" / "real_vllm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(python: str, env_extra: dict, cwd: Path) -> list:
    import json

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVGATE_CPU_MASK")}
    env.update(env_extra)
    r = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env, cwd=cwd)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture
def fake_torch(tmp_path):
    pkg = tmp_path / "fake" / "torch"
    (pkg / "cpu").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cpu" / "__init__.py").write_text(FAKE_TORCH_CPU)
    return tmp_path / "fake"


def test_isa_env_levels():
    rv = _real_vllm_module()
    assert rv.isa_env("native") == {}
    for isa in ("avx512_bf16", "avx512", "avx2"):
        env = rv.isa_env(isa)
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(SHIM)
        assert "amx_*" in env["KVGATE_CPU_MASK"].split(",")
        assert env["ONEDNN_MAX_CPU_ISA"]  # oneDNN is capped too, not only what Python sees
    assert "avx512*" in rv.isa_env("avx2")["KVGATE_CPU_MASK"].split(",")
    assert rv.isa_env("avx2")["ATEN_CPU_CAPABILITY"] == "avx2"
    with pytest.raises(ValueError, match="--cpu-isa must be one of"):
        rv.isa_env("avx9")


@pytest.mark.parametrize("isa, expected", [
    ("native", [True, True, True, True, 2]),
    ("avx512_bf16", [False, True, True, True, 2]),
    ("avx512", [False, True, False, True, 2]),
    ("avx2", [False, False, False, True, 2]),   # non-boolean entries are left alone
])
def test_shim_hides_capabilities(fake_torch, tmp_path, isa, expected):
    env = _real_vllm_module().isa_env(isa)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (env.get("PYTHONPATH"), str(fake_torch)) if x)
    assert _run(sys.executable, env, tmp_path) == expected


def test_bad_cpu_isa_is_refused_before_a_server_starts(tmp_path):
    script = str(ROOT / "benchmarks" / "real_vllm.py")
    base = [sys.executable, script, "--model", "tiny", "--venv-python", "/bin/false", "--out", str(tmp_path / "o")]
    r = subprocess.run([*base, "--cpu-isa", "avx9"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 2 and "invalid choice: 'avx9'" in r.stderr
    r = subprocess.run(base, capture_output=True, text=True, timeout=60, cwd=tmp_path,
                       env={**os.environ, "CPU_ISA": "avx9"})
    assert r.returncode == 2 and "--cpu-isa must be one of" in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.vllm
def test_shim_against_the_real_pytorch_and_vllm(tmp_path):
    """In the vLLM venv: real torch.cpu sees the masked CPU, and vLLM picks its AVX2 kernels."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "no vLLM here"
        pytest.skip(f"vllm is not importable in this interpreter: {e}")
    rv = _real_vllm_module()
    native = _run(sys.executable, {}, tmp_path)
    if not native[0]:
        pytest.skip("this CPU has no AMX: nothing for --cpu-isa avx512_bf16 to hide")
    assert _run(sys.executable, rv.isa_env("avx512_bf16"), tmp_path)[:3] == [False, native[1], native[2]]
    assert _run(sys.executable, rv.isa_env("avx2"), tmp_path)[:3] == [False, False, False]
    # vLLM chooses its CPU attention kernel from the same capabilities
    code = ("import torch; from vllm.v1.attention.backends import cpu_attn as a; "
            "print(a._get_attn_isa(torch.bfloat16, 32))")
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **rv.isa_env("avx2")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] != "amx"


def test_matmul_script_refuses_bad_arguments(tmp_path):
    script = str(ROOT / "benchmarks" / "cpu_isa_matmul.py")
    for args, needle in ((["--shape", "1024,512"], "--shape must be M,K,N"),
                         (["--reps", "0"], "must be positive")):
        r = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert r.returncode == 2 and needle in r.stderr, r.stderr


@pytest.mark.vllm
def test_matmul_script_runs(tmp_path):
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_isa_matmul.py"), "--shape", "64,64,64",
                        "--reps", "2", "--rounds", "1"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 6 and "ONEDNN_MAX_CPU_ISA=AVX2" in lines[-1]
    assert lines[1].split()[-1] == "1.0x"  # native against itself


def test_the_wrapper_records_its_server_in_bench_json(tmp_path):
    import json

    rv = _real_vllm_module()
    path = tmp_path / "bench.json"
    rv.note_server(str(path), {"cpu_isa": "avx2"})  # no file: the bench failed first; nothing to add to
    assert not path.exists()
    path.write_text(json.dumps({"policies": [], "argv": ["--engine", "http://x"]}))
    rv.note_server(str(path), {"model": "heavy", "cpu_isa": "avx2"})
    doc = json.loads(path.read_text())
    assert doc["vllm_server"] == {"model": "heavy", "cpu_isa": "avx2"} and doc["argv"] == ["--engine", "http://x"]
    # an earlier run's file, left in --out when this run failed before writing: not relabelled
    old = path.stat().st_mtime
    rv.note_server(str(path), {"cpu_isa": "native"}, written_after=old + 60)
    assert json.loads(path.read_text())["vllm_server"]["cpu_isa"] == "avx2"


@pytest.mark.parametrize("cpu_isa,host_isa,level", [
    ("native", "avx2", "avx2"),          # this session's AMD box, as it is
    ("native", "amx", "amx"),
    ("avx2", "amx", "avx2"),             # the slow class emulated on an AMX box
    ("avx512", "avx512_bf16", "avx512"),
    ("avx512_bf16", "avx2", "avx2"),     # hiding AMX on an AVX2 box changes nothing
    ("avx512", "unknown", "avx512"),     # host not known: the emulated level is an upper bound
])
def test_the_recorded_level_is_the_lower_of_host_and_emulation(cpu_isa, host_isa, level):
    assert _real_vllm_module().effective_isa(cpu_isa, host_isa) == level
