"""Where a turn's server time goes inside the scripts, statement by statement.

    python benchmarks/lua_profile.py [--turns N] [--quick] [--json]

``benchmarks/overhead.py`` says what a turn costs Redis in all and what each step costs run
alone; this says what each statement of ``acquire.lua`` and ``release.lua`` costs where it
runs, in the turn ``overhead.py`` measures (a 5,000-token prompt, sessions that repeat, so
after its first turn a session enters through its ownership window). Redis's Lua has no
clock of its own (no ``os.clock``), so the profile is a checkpoint before every top-level
statement of the two scripts' bodies and of the helpers named by ``--into``, each one a
``TIME`` call that adds the time since the last checkpoint to the statement before it. A
statement's figure therefore excludes the instrumented helpers it calls (their statements
have their own rows, under the helper's name), and includes everything else it runs: the
commands it sends, the Lua around them, the uninstrumented helpers. The checkpoints' own cost
is measured in the same run (checkpoints in a row with nothing between them) and taken off
every row. ``begin`` (the call's keys, clock and parameters), ``finish`` (the ledger written back)
and the reply are rows of their own.

It works on a copy of ``lua/`` in a temporary directory, loaded as its own function library
(its name carries its digest, so it never replaces the real one) on a private redis-server;
the gate object it drives calls that library instead of the real one. The rows' sum is the
instrumented call's time less the checkpoints; the same turns on the real library are timed
beside it (``INFO commandstats``) for comparison. ``--quick`` is a smoke run.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if (_ROOT / "kvgate" / "__init__.py").is_file():
    sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import redis  # noqa: E402

import kvgate  # noqa: E402
import overhead  # noqa: E402
from kvgate.client.scripts import INCLUDE_RE, library_source, lua_dir  # noqa: E402
from kvgate.tools.bench.redis_embed import embedded_redis  # noqa: E402

SCRIPTS = ("acquire", "release")
#: helpers whose statements get rows of their own by default: the lease's grant and its return
INTO = ("grant", "free_lease")
#: the hash the instrumented library adds its sums to, every FLUSH calls
PROFILE_KEY = "kvgate-lua-profile"
FLUSH = 100
#: Lua's statement keywords that continue a statement rather than start one
CONTINUES = ("end", "else", "elseif", "until", "}", ")", "--")

CHECKPOINT = """
-- (lua_profile.py) the profile's checkpoints: the time since the last one goes to LABEL
local PROF_US, PROF_N, PROF_T, PROF_LABEL, PROF_CALLS = {}, {}, nil, nil, 0
local function CP(label)
  local t = redis.call("TIME")
  local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  if PROF_T ~= nil then
    PROF_US[PROF_LABEL] = (PROF_US[PROF_LABEL] or 0) + (us - PROF_T)
    PROF_N[PROF_LABEL] = (PROF_N[PROF_LABEL] or 0) + 1
  end
  PROF_T, PROF_LABEL = us, label
end
local function CP_FLUSH()
  PROF_T = nil
  PROF_CALLS = PROF_CALLS + 1
  if PROF_CALLS % @FLUSH@ == 0 then
    local args = {}
    for k, v in pairs(PROF_US) do
      args[#args + 1] = "us|" .. k; args[#args + 1] = string.format("%d", v)
      args[#args + 1] = "n|" .. k; args[#args + 1] = string.format("%d", PROF_N[k])
    end
    redis.call("HSET", "@KEY@", "calls", string.format("%d", PROF_CALLS), unpack(args))
  end
end
""".replace("@KEY@", PROFILE_KEY).replace("@FLUSH@", str(FLUSH))


def statement_lines(lines: list[str], indent: int, start: int, stop: int) -> list[int]:
    """The lines in [start, stop) that start a statement at exactly ``indent`` spaces."""
    out = []
    for i in range(start, stop):
        text = lines[i]
        body = text.strip()
        if not body or len(text) - len(text.lstrip(" ")) != indent:
            continue
        if body.startswith(CONTINUES) or body.startswith("local function"):
            continue
        out.append(i)
    return out


def instrument(lines: list[str], at: list[int], name: str, indent: int) -> list[str]:
    """``lines`` with a checkpoint before each line of ``at``, labelled ``name:line text``."""
    marks = set(at)
    out = []
    for i, text in enumerate(lines):
        if i in marks:
            label = f"{name}:{i + 1} {text.strip()[:48]}".replace("\\", "\\\\").replace('"', '\\"')
            out.append(" " * indent + f'CP("{label}")')
        out.append(text)
    return out


def profiled_lua(dest: Path, into: tuple[str, ...] = INTO) -> Path:
    """A copy of lua/ at ``dest`` with the checkpoints in; returns its directory."""
    src = lua_dir()
    target = dest / "lua"
    shutil.copytree(src, target)
    common = target / "includes" / "common.lua"
    text = common.read_text()
    anchor = "local K = {}"
    run_old = "  begin(keys, argv)\n  local ok, res = pcall(main)\n  finish()\n"
    # the checkpoints' own cost: three in a row after the call's work, warm as the others are
    run_new = ('  CP("(begin)")\n  begin(keys, argv)\n  CP("(body)")\n'
               '  local ok, res = pcall(main)\n  CP("(finish)")\n  finish()\n'
               '  CP("(checkpoint)")\n  CP("(checkpoint)")\n  CP("(checkpoint)")\n  CP_FLUSH()\n')
    if anchor not in text or run_old not in text:
        raise SystemExit("lua_profile: lua/includes/common.lua changed shape; update profiled_lua()")
    common.write_text(text.replace(anchor, CHECKPOINT + anchor, 1).replace(run_old, run_new, 1))
    for name in SCRIPTS:
        path = target / f"{name}.lua"
        lines = path.read_text().split("\n")
        body = max(i for i, t in enumerate(lines) if INCLUDE_RE.match(t)) + 1
        path.write_text("\n".join(instrument(lines, statement_lines(lines, 0, body, len(lines)),
                                             path.name, 0)))
    for fn in into:
        hits = [p for p in (target / "includes").glob("*.lua")
                if re.search(rf"^local function {fn}\(", p.read_text(), re.M)]
        if len(hits) != 1:
            raise SystemExit(f"lua_profile: helper {fn!r} is defined in {len(hits)} includes, not one")
        lines = hits[0].read_text().split("\n")
        first = next(i for i, t in enumerate(lines) if t.startswith(f"local function {fn}("))
        last = next(i for i in range(first + 1, len(lines)) if lines[i].startswith("end"))
        hits[0].write_text("\n".join(instrument(lines, statement_lines(lines, 2, first + 1, last),
                                                f"{fn}()", 2)))
    return target


def profile(url: str, turns: int, into: tuple[str, ...]) -> dict[str, Any]:
    r = redis.Redis.from_url(url, **overhead.client_kw())
    real = kvgate.Gate(r, gate="lua-profile-real", config=overhead.config())
    real.write_snapshot(overhead.engine(overhead.ROOMY_TOKENS))
    prof = kvgate.Gate(r, gate="lua-profile", config=overhead.config())
    prof.write_snapshot(overhead.engine(overhead.ROOMY_TOKENS))
    with tempfile.TemporaryDirectory() as tmp:
        lib, names = library_source(str(profiled_lua(Path(tmp), into)))
    prof._caller.library, prof._caller.functions = lib, names  # the instrumented library

    def turns_on(g: kvgate.Gate, n: int) -> None:
        turn = overhead.turn_on(g)
        for i in range(n):
            turn(i)

    # warm-up: both libraries loaded, the sessions' windows open, and the profile's sums
    # started afresh after it
    turns_on(real, 2 * overhead.SESSIONS)
    turns_on(prof, 2 * overhead.SESSIONS)
    r.delete(PROFILE_KEY)
    r.config_resetstat()
    turns_on(real, turns)
    fcall = overhead.command_stats(r).get("fcall", {"usec": 0, "calls": 0})
    turns_on(prof, turns)
    raw = {k.decode(): int(v) for k, v in r.hgetall(PROFILE_KEY).items()}
    real.close()
    prof.close()
    r.close()
    calls = raw.pop("calls")
    us, n = defaultdict(int), defaultdict(int)
    for k, v in raw.items():
        kind, label = k.split("|", 1)
        (us if kind == "us" else n)[label] = v
    cp = us.pop("(checkpoint)") / n.pop("(checkpoint)")  # one checkpoint's own cost
    n_turns = calls / 2
    rows = sorted(((label, n[label] / n_turns, (us[label] - cp * n[label]) / n_turns) for label in us),
                  key=lambda row: _order(row[0]))
    return {"turns": n_turns, "checkpoint_us": cp, "into": list(into),
            "real_us_per_turn": fcall["usec"] / turns if turns else 0.0,
            "profiled_us_per_turn": sum(row[2] for row in rows),
            "rows": [{"statement": label, "per_turn": k, "us_per_turn": v} for label, k, v in rows]}


def _order(label: str) -> tuple:
    """Rows in reading order: the call's set-up, acquire's statements, release's, the helpers'."""
    name, _, rest = label.partition(":")
    line = int(rest.split(" ", 1)[0]) if rest[:1].isdigit() else 0
    rank = {"acquire.lua": 1, "release.lua": 2}.get(name, 0 if label.startswith("(") else 3)
    return rank, name, line


def report(res: dict[str, Any]) -> str:
    out = [f"{res['turns']:.0f} turns; one checkpoint costs {res['checkpoint_us']:.2f} us, taken off every row",
           f"server us per turn: {res['real_us_per_turn']:.1f} on the real library (INFO commandstats), "
           f"{res['profiled_us_per_turn']:.1f} in the rows below", "",
           f"{'us/turn':>8} {'runs/turn':>9}  statement"]
    for row in res["rows"]:
        out.append(f"{row['us_per_turn']:8.2f} {row['per_turn']:9.2f}  {row['statement']}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=10000, help="profiled turns (a multiple of 50)")
    p.add_argument("--into", default=",".join(INTO),
                   help="helpers of lua/includes whose statements get rows of their own (comma-separated)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 500 turns")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    turns = 500 if args.quick else args.turns
    if turns <= 0 or turns % (FLUSH // 2):
        p.error(f"--turns must be a positive multiple of {FLUSH // 2}")
    into = tuple(x for x in args.into.split(",") if x)
    with embedded_redis("redis-server") as (url, _kind):
        res = profile(url, turns, into)
    print(json.dumps(res, indent=1) if args.json else report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
