"""The script loader (includes inlined once, after what they need; cycles and missing
includes are errors) and the shipped copy: the wheel's kvgate/lua must equal lua/ byte for
byte. What each script's header declares is checked in test_lua_headers.py."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvgate.client import scripts
ROOT = Path(__file__).resolve().parent.parent


def test_render_inlines_each_include_once():
    incs = {"a": "A1\n--@include b", "b": "B1", "c": "--@include a\nC1"}
    out = scripts.render("--@include a\n--@include c\nBODY", incs.__getitem__)
    assert out.count("A1") == 1 and out.count("B1") == 1 and out.count("C1") == 1
    assert out.index("A1") < out.index("B1") < out.index("C1") < out.index("BODY")
    assert "already inlined" in out


def test_render_puts_each_include_after_what_it_needs():
    # the script lists the includes in any order; each include names its own needs
    incs = {"base": "BASE", "mid": "--@include base\nMID", "top": "--@include mid\n--@include base\nTOP"}
    out = scripts.render("--@include top\n--@include mid\n--@include base\nBODY", incs.__getitem__)
    assert [out.count(x) for x in ("BASE", "MID", "TOP")] == [1, 1, 1]
    assert out.index("BASE") < out.index("MID") < out.index("TOP") < out.index("BODY")


def test_render_refuses_an_include_cycle():
    incs = {"a": "--@include b\nA", "b": "--@include c\nB", "c": "--@include a\nC"}
    with pytest.raises(ValueError, match="include cycle: a -> b -> c -> a"):
        scripts.render("--@include a\nBODY", incs.__getitem__)
    with pytest.raises(ValueError, match="include cycle: d -> d"):
        scripts.render("--@include d", {"d": "--@include d"}.__getitem__)


def test_every_script_renders_without_include_lines():
    for name in scripts.SCRIPT_NAMES:
        src = scripts.script_source(name)
        assert "--@include" not in src
        assert "local K = {" in src  # common.lua made it in


def test_unknown_script_and_missing_include(tmp_path):
    with pytest.raises(ValueError, match="unknown kvgate script"):
        scripts.script_source("nope")
    (tmp_path / "includes").mkdir()
    (tmp_path / "acquire.lua").write_text("--@include missing\n")
    with pytest.raises(FileNotFoundError, match="missing"):
        scripts.script_source.__wrapped__("acquire", str(tmp_path))


@pytest.mark.slow
def test_wheel_ships_lua_identical_to_source(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path)], check=True, timeout=240)
    wheel = next(tmp_path.glob("kvgate-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        shipped = {n[len("kvgate/lua/"):]: z.read(n) for n in z.namelist()
                   if n.startswith("kvgate/lua/") and n.endswith(".lua")}
    source = {str(p.relative_to(ROOT / "lua")): p.read_bytes() for p in (ROOT / "lua").rglob("*.lua")}
    assert shipped == source
