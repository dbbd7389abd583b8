"""The script loader (includes inlined once, after what they need; cycles and missing
includes are errors), its two forms (one function library, or EVAL scripts) and how a gate
object's calls pick one (``ScriptCaller``), and the shipped copy: the wheel's kvgate/lua must
equal lua/ byte for byte. What each script's header declares is checked in test_lua_headers.py."""
from __future__ import annotations

import logging
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import redis

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


# -- the two forms, and how a gate object picks one (no Redis: the call is a sans-I/O flow) ---
def test_the_library_defines_each_helper_once_and_registers_every_script():
    src, names = scripts.library_source()
    assert src.startswith("#!lua name=kvgate_")
    assert src.count("-- >>> include common") == 1 and "--@include" not in src
    assert src.count("local function begin(") == 1
    for n in scripts.SCRIPT_NAMES:
        assert names[n].startswith("kvgate_") and names[n].endswith("_" + n)
        assert f"redis.register_function('{names[n]}'" in src
    # the names carry the text's digest: another text, other names
    tag = names["acquire"].split("_")[1]
    assert src.splitlines()[0] == f"#!lua name=kvgate_{tag}"


def drive(caller, name, answers):
    """Run ``caller.call`` against scripted answers, one per command it sends (an exception
    is raised into it): (the commands sent, its result)."""
    call = caller.call(name, ["k1", "k2"], ["", "{}"])
    sent, reply, error = [], None, None
    while True:
        try:
            cmd = call.throw(error) if error is not None else call.send(reply)
        except StopIteration as done:
            return sent, done.value
        sent.append(cmd.name)
        answer = answers.pop(0)
        reply, error = (None, answer) if isinstance(answer, BaseException) else (answer, None)


def test_a_call_loads_the_missing_library_and_calls_again():
    c = scripts.ScriptCaller()
    sent, out = drive(c, "acquire", [redis.ResponseError("ERR Function not found"), "OK", "reply"])
    assert sent == ["fcall", "function_load", "fcall"] and out == "reply" and c.use_functions
    sent, out = drive(c, "release", ["r3"])
    assert sent == ["fcall"] and out == "r3"


@pytest.mark.parametrize("refusal", [
    redis.ResponseError("ERR unknown command 'FCALL', with args beginning with: 'kvgate_x'"),  # Redis 6.2
    redis.exceptions.NoPermissionError("this user has no permissions to run the 'fcall' command"),
])
def test_a_server_that_cannot_run_functions_gets_eval_from_then_on(refusal, caplog):
    c = scripts.ScriptCaller()
    with caplog.at_level(logging.INFO, logger="kvgate"):
        sent, out = drive(c, "acquire", [refusal, "reply"])
    assert sent == ["fcall", "evalsha"] and out == "reply" and c.use_functions is False
    # said once, with what to grant
    assert [r.levelname for r in caplog.records if "EVAL scripts" in r.getMessage()] == ["INFO"]
    assert "+fcall +function|load" in caplog.records[-1].getMessage()
    sent, out = drive(c, "acquire", [redis.exceptions.NoScriptError("NOSCRIPT"), "OK", "again"])
    assert sent == ["evalsha", "script_load", "evalsha"] and out == "again"


def test_a_refused_library_load_falls_back_to_eval():
    c = scripts.ScriptCaller()
    sent, out = drive(c, "acquire", [redis.ResponseError("ERR Function not found"),
                                     redis.exceptions.NoPermissionError(
                                         "this user has no permissions to run the 'function|load' command"),
                                     "reply"])
    assert sent == ["fcall", "function_load", "evalsha"] and out == "reply" and not c.use_functions


def test_a_library_the_server_refuses_falls_back_to_eval_with_a_warning(caplog):
    c = scripts.ScriptCaller()
    refused = redis.ResponseError("ERR Error registering functions: Script attempted to access nonexistent global")
    sent, out = drive(c, "acquire", [redis.ResponseError("ERR Function not found"), refused, "reply"])
    assert sent == ["fcall", "function_load", "evalsha"] and out == "reply" and not c.use_functions
    assert any("function library" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


@pytest.mark.parametrize("fault", [redis.exceptions.OutOfMemoryError("OOM command not allowed"),
                                   redis.exceptions.ReadOnlyError("You can't write against a read only replica.")])
def test_a_load_refused_for_now_is_a_fault_and_the_next_call_loads_again(fault):
    c = scripts.ScriptCaller()
    with pytest.raises(type(fault)):
        drive(c, "acquire", [redis.ResponseError("ERR Function not found"), fault])
    sent, out = drive(c, "acquire", [redis.ResponseError("ERR Function not found"), "OK", "reply"])
    assert sent == ["fcall", "function_load", "fcall"] and c.use_functions


@pytest.mark.parametrize("error", [
    # a command refused inside the function: a configuration error, not a missing function
    redis.ResponseError("ERR The user executing the script can't run this command or subcommand"),
    # the function's own error (a missing parameter), and a fault
    redis.ResponseError("ERR kvgate: missing required parameter 'ticket' in ARGV[2]"),
    redis.ConnectionError("down"),
])
def test_other_errors_of_a_call_are_raised_as_they_came(error):
    c = scripts.ScriptCaller()
    with pytest.raises(type(error)):
        drive(c, "acquire", [error])
    assert c.use_functions
