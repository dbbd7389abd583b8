"""Loading kvgate's Lua scripts.

The scripts live in ``lua/`` at the project root and ship inside the wheel as
``kvgate/lua`` (hatch force-include). Each script file may pull shared helpers from
``lua/includes/`` with a line ``--@include name``; the loader inlines each include once,
after the includes it names itself (dependency order; a cycle is an error), so a script is
one self-contained chunk that Redis caches by SHA. What follows a script's last include line
(its body) runs as a function, ``main``, after which ``finish`` (lua/includes/common.lua)
writes back what the call buffered (the ledger's fields), whichever ``return`` it took or
error it raised (``as_main``). Each file's header block says
what it reads (tests/test_lua_headers.py checks it).

Scripts are called through redis-py's ``Script`` objects: EVALSHA first, and on NOSCRIPT
(after ``SCRIPT FLUSH`` or a Redis restart) the script is loaded again transparently.
"""
from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources
from pathlib import Path

INCLUDE_RE = re.compile(r"^--@include\s+([A-Za-z0-9_]+)\s*$", re.M)

#: Every script kvgate calls, by file stem.
SCRIPT_NAMES = ("acquire", "release", "cancel", "finish_session", "housekeep",
                "write_snapshot", "bump_epoch", "drain_stats")


def lua_dir() -> Path:
    """Where the scripts are: the wheel's ``kvgate/lua``, else the source tree's ``lua/``."""
    shipped = resources.files("kvgate") / "lua"
    if shipped.is_dir():
        return Path(str(shipped))
    src = Path(__file__).resolve().parents[2] / "lua"
    if src.is_dir():
        return src
    raise FileNotFoundError("kvgate Lua scripts not found (neither kvgate/lua nor ../lua)")


def render(source: str, read_include, _seen: set[str] | None = None, _stack: tuple[str, ...] = ()) -> str:
    """Inline ``--@include name`` lines, each include at most once. An include names what it
    needs with its own ``--@include`` lines, so it lands after everything it uses (dependency
    order, whatever order the script lists them in); a cycle is an error, since one side of it
    would run before what it needs is defined."""
    seen = set() if _seen is None else _seen

    def sub(m: re.Match) -> str:
        name = m.group(1)
        if name in _stack:
            raise ValueError("include cycle: " + " -> ".join((*_stack[_stack.index(name):], name)))
        if name in seen:
            return f"-- (include {name}: already inlined)"
        seen.add(name)
        body = read_include(name)
        return f"-- >>> include {name}\n{render(body, read_include, seen, (*_stack, name))}\n-- <<< include {name}"

    return INCLUDE_RE.sub(sub, source)


@lru_cache(maxsize=None)
def script_source(name: str, directory: str | None = None) -> str:
    """The full text of script ``name`` with its includes inlined."""
    if name not in SCRIPT_NAMES:
        raise ValueError(f"unknown kvgate script {name!r}; known: {', '.join(SCRIPT_NAMES)}")
    base = Path(directory) if directory else lua_dir()

    def read_include(inc: str) -> str:
        path = base / "includes" / f"{inc}.lua"
        if not path.is_file():
            raise FileNotFoundError(f"script {name}: include {inc!r} not found at {path}")
        return path.read_text()

    return as_main(render((base / f"{name}.lua").read_text(), read_include))


def as_main(rendered: str) -> str:
    """Wrap a rendered script's body (what follows its last inlined include) in ``main``, and
    run it so that ``finish`` writes back what it buffered on every exit: its answer, and an
    error raised midway too (a command Redis refused), since Redis keeps whatever the script
    wrote before the error and the ledger must agree with it. The error is then raised as it
    was (an error reply stays one)."""
    cut = rendered.rfind("\n-- <<< include ")
    cut = 0 if cut < 0 else rendered.index("\n", cut + 1) + 1
    return (f"{rendered[:cut]}local function main()\n{rendered[cut:]}\nend\n"
            "local ok, res = pcall(main)\nfinish()\nif not ok then error(res, 0) end\nreturn res\n")
