"""Loading and calling kvgate's Lua scripts.

The scripts live in ``lua/`` at the project root and ship inside the wheel as
``kvgate/lua`` (hatch force-include). Each script file may pull shared helpers from
``lua/includes/`` with a line ``--@include name``; the loader inlines each include once,
after the includes it names itself (dependency order; a cycle is an error). What follows a
script's last include line (its body) runs as a function through ``run``
(lua/includes/common.lua): ``begin`` sets up the call (its keys, clock and parameters), the
body runs, and ``finish`` writes back what the call buffered (the ledger's fields) whichever
``return`` it took or error it raised. Each file's header block says what it reads
(tests/test_lua_headers.py checks it).

Two forms of the same text, one per way Redis runs Lua:

- the function library (``library_source``, Redis >= 7.0): every script a function of one
  library, loaded once per server (``FUNCTION LOAD``), called with ``FCALL``. The helpers are
  defined when the library loads, not on every call.
- one EVAL script per script (``script_source``): for a server without functions (Redis 6.2)
  or a user not allowed them; called with ``EVALSHA``, loaded on ``NOSCRIPT``.

``ScriptCaller`` picks the form: the library first, loading it when the server lacks it
(after a restart, a ``FUNCTION FLUSH``, on a new cluster node), and EVAL from then on when the
server cannot run functions or refuses this user them (docs/decisions.md#script-form).
"""
from __future__ import annotations

import hashlib
import logging
import re
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Generator, Sequence

import redis.exceptions as redis_errors

from .flows import Command

log = logging.getLogger("kvgate")

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


def _reader(name: str, base: Path):
    def read_include(inc: str) -> str:
        path = base / "includes" / f"{inc}.lua"
        if not path.is_file():
            raise FileNotFoundError(f"script {name}: include {inc!r} not found at {path}")
        return path.read_text()
    return read_include


def _split(name: str, base: Path) -> tuple[str, str]:
    """Script ``name``'s file as (its header and include lines, its body): the body is what
    follows the last include line."""
    if name not in SCRIPT_NAMES:
        raise ValueError(f"unknown kvgate script {name!r}; known: {', '.join(SCRIPT_NAMES)}")
    text = (base / f"{name}.lua").read_text()
    cut = 0
    for m in INCLUDE_RE.finditer(text):
        cut = m.end()
    return text[:cut], text[cut:]


def _main(fn: str, body: str) -> str:
    """A script's body as a function: each call runs it through ``run`` (lua/includes/common.lua:
    begin, the body, then finish, which writes back what the call buffered, on every exit)."""
    return f"local function {fn}()\n{body}\nend\n"


@lru_cache(maxsize=None)
def script_source(name: str, directory: str | None = None) -> str:
    """The full text of script ``name`` for EVAL: its includes inlined, its body run as a
    function (``run``) with the call's KEYS and ARGV."""
    base = Path(directory) if directory else lua_dir()
    head, body = _split(name, base)
    return f"{render(head, _reader(name, base))}\n{_main('main', body)}return run(KEYS, ARGV, main)\n"


@lru_cache(maxsize=None)
def library_source(directory: str | None = None) -> tuple[str, dict[str, str]]:
    """Every script as one Redis function library (Redis >= 7.0 ``FUNCTION LOAD``), and the
    function name of each script. The includes are inlined once and define the helpers once,
    when the library loads, instead of on every call as an EVAL script's do (docs/benchmarks.md,
    where the server time goes). The library's and the functions' names carry a digest of
    the text, so processes running different kvgate versions against one Redis each call
    their own."""
    base = Path(directory) if directory else lua_dir()
    seen: set[str] = set()
    heads, mains = [], []
    for name in SCRIPT_NAMES:
        head, body = _split(name, base)
        heads.append(render(head, _reader(name, base), seen))
        mains.append(_main(f"main_{name}", body))
    code = "\n".join(heads) + "\n" + "".join(mains)
    tag = hashlib.sha1(code.encode()).hexdigest()[:16]
    names = {n: f"kvgate_{tag}_{n}" for n in SCRIPT_NAMES}
    register = "".join(f"redis.register_function('{names[n]}', function(keys, argv) "
                       f"return run(keys, argv, main_{n}) end)\n" for n in SCRIPT_NAMES)
    return f"#!lua name=kvgate_{tag}\n{code}{register}", names


def _says(error: BaseException, words: str) -> bool:
    return words in str(error).lower()


@lru_cache(maxsize=None)
def eval_scripts() -> tuple[dict[str, str], dict[str, str]]:
    """The EVAL form of every script, and the SHA1 it is cached under (``EVALSHA``)."""
    sources = {n: script_source(n) for n in SCRIPT_NAMES}
    return sources, {n: hashlib.sha1(src.encode()).hexdigest() for n, src in sources.items()}


class ScriptCaller:
    """How one gate object calls the scripts: ``call`` is a sans-I/O flow of the commands one
    script call takes (each driver performs them, and throws a failed one's redis-py error
    back in). Any error it does not handle here is raised as the client raised it."""

    def __init__(self) -> None:
        self.library, self.functions = library_source()
        self.sources, self.shas = eval_scripts()
        # False once the server showed it cannot run functions for this user: EVAL from then on
        self.use_functions = True

    def call(self, name: str, keys: Sequence[str], argv: Sequence[Any]) -> Generator[Command, Any, Any]:
        """The reply of script ``name`` called with ``keys`` and ``argv``."""
        if self.use_functions:
            fcall = Command("fcall", (self.functions[name], len(keys), *keys, *argv))
            try:
                return (yield fcall)
            except redis_errors.ResponseError as e:
                if not self._not_callable(e):
                    raise
            if self.use_functions and (yield from self._load_library()):
                return (yield fcall)
        evalsha = Command("evalsha", (self.shas[name], len(keys), *keys, *argv))
        try:
            return (yield evalsha)
        except redis_errors.NoScriptError:
            yield Command("script_load", (self.sources[name],))
        return (yield evalsha)

    def _not_callable(self, error: redis_errors.ResponseError) -> bool:
        """FCALL failed before the function ran: the library is not loaded (True), or the
        server cannot run functions for this user (True, and EVAL from now on). An error the
        function itself raised, or a command refused inside it, is not this."""
        if _says(error, "function not found"):
            return True
        if self._no_functions(error, "fcall"):
            self._to_eval(error)
            return True
        return False

    def _load_library(self) -> Generator[Command, Any, bool]:
        """Load the library (on every primary of a cluster); True when it is there now.
        REPLACE: a server that has it already (another process loaded it, or a cluster's
        other primaries) loads the same text again instead of refusing, so every primary
        answers alike and none is left without it."""
        try:
            yield Command("function_load", (self.library,), {"replace": True})
        except (redis_errors.OutOfMemoryError, redis_errors.ReadOnlyError):
            raise  # a fault of this server now (full, or a replica): the next call tries again
        except redis_errors.ResponseError as e:
            if self._no_functions(e, "function"):
                self._to_eval(e)
            else:
                # the server refused the library itself (a Redis whose function environment
                # differs from the one it was written for): the EVAL form runs the same rules
                log.warning("kvgate: Redis refused the scripts' function library (%s); "
                            "this gate object calls them as EVAL scripts", e)
                self.use_functions = False
            return False
        return True

    def _to_eval(self, error: BaseException) -> None:
        """EVAL from now on, said once: the server has no functions, or this user may not
        run them (the EVAL form costs Redis more per turn; docs/decisions.md#script-form)."""
        log.info("kvgate: Redis cannot run the scripts as functions for this user (%s); this gate "
                 "object calls them as EVAL scripts (grant +fcall +function|load on Redis >= 7.0 "
                 "to use the function library: docs/deploy.md#acl)", error)
        self.use_functions = False

    @staticmethod
    def _no_functions(error: redis_errors.ResponseError, command: str) -> bool:
        """The server has no such command (before Redis 7.0), or the ACL refuses it to this
        user (NOPERM naming the command itself, not one run inside a script)."""
        if _says(error, "unknown command"):
            return True
        return isinstance(error, redis_errors.NoPermissionError) and _says(error, f"'{command}")
