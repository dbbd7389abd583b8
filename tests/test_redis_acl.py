"""kvgate under a least-privilege Redis ACL user: the line in docs/deploy.md#acl is enough
for the gate, the async gate, a poller tick and ``status`` (the test reads the line from the
page, so the page and the test cannot drift), and a user that lacks one permission gets
``kvgate.RedisAccessDenied`` naming it from its first call, instead of every turn bypassing as
``degraded`` for as long as the process runs."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import redis

import kvgate
from kvgate.client import access
from kvgate.client.scripts import lua_dir
from kvgate.control.poller import Poller
from kvgate.tools.sim import SimCluster

from _deployflow import core_flow
from _gatehelpers import config, engines, ledger_consistent, script
from _simhelpers import SMALL
from conftest import start_redis

ROOT = Path(__file__).resolve().parents[1]
PASSWORD = "CHANGE-ME"  # the page's placeholder, used as is: the line runs exactly as written


def documented_acl() -> list[str]:
    """The ``ACL SETUSER kvgate ...`` line of docs/deploy.md, split as redis-cli would."""
    lines = [ln.strip() for ln in (ROOT / "docs" / "deploy.md").read_text().splitlines()
             if ln.strip().startswith("ACL SETUSER kvgate ")]
    assert len(lines) == 1, f"docs/deploy.md must hold one ACL SETUSER kvgate line, found {len(lines)}"
    return shlex.split(lines[0])


def granted_commands(acl: list[str]) -> set[str]:
    return {a[1:] for a in acl if a.startswith("+")}


# -- the line covers what the code sends (no Redis) -----------------------------------------
def test_documented_line_grants_exactly_the_required_commands():
    acl = documented_acl()
    assert granted_commands(acl) == set(access.REQUIRED_COMMANDS)
    # nothing else: no category, and keys and channels only under kvgate's prefix
    assert "-@all" in acl and not any(a.startswith("+@") for a in acl)
    assert [a for a in acl if a[0] in "~&%"] == ["~kvgate:*", "&kvgate:*"]


def test_required_commands_cover_every_command_the_scripts_run():
    # kvgate's scripts, and redis-py's lock scripts the poller's leader lease runs
    called = set()
    for path in lua_dir().rglob("*.lua"):
        called |= {c.lower() for c in re.findall(r"redis\.p?call\(\s*['\"](\w+)['\"]", path.read_text())}
    import redis.lock as rlock
    called |= {c.lower() for c in re.findall(r"redis\.call\('(\w+)'", Path(rlock.__file__).read_text())}
    assert called, "no redis.call found: the pattern no longer matches the scripts"
    assert called <= set(access.REQUIRED_COMMANDS), called - set(access.REQUIRED_COMMANDS)


def test_access_probe_sends_every_required_command_but_pubsub():
    probed = set()
    for c in access.probe_commands("g").commands:
        name = c.args[0].lower()
        probed.add(f"{name}|{c.args[1].lower()}" if name in ("script", "function") else name)
    assert probed == set(access.REQUIRED_COMMANDS) - {"subscribe", "unsubscribe"}


# -- against a real redis-server ----------------------------------------------------------
@pytest.fixture
def acl_server():
    """A private redis-server and a function that creates the kvgate user with an ACL line
    (the documented one unless told otherwise): the user's URL."""
    rp = start_redis()
    admin = rp.client()

    def user(acl: list[str] | None = None) -> str:
        admin.execute_command(*(acl or documented_acl()))
        return f"redis://kvgate:{PASSWORD}@127.0.0.1:{rp.port}/0"

    yield user
    admin.close()
    rp.stop()


@pytest.mark.redis_real
def test_core_flow_runs_as_the_documented_user(acl_server, driver):
    core_flow(driver, acl_server())


def without(acl: list[str], *drop: str) -> list[str]:
    return [a for a in acl if a not in drop]


@pytest.mark.redis_real
@pytest.mark.parametrize("drop, named", [
    (("+hset",), "hset"),               # refused inside a script: Redis does not say which
    (("+fcall", "+evalsha"), "evalsha"),  # refused before any script runs, in both forms
])
def test_a_user_without_a_permission_is_told_which_at_the_first_turn(acl_server, driver, drop, named):
    url = acl_server(without(documented_acl(), *drop))
    gate = driver.from_url(url, gate="acl", config=config())
    try:
        for _ in range(2):  # the second turn too: a refusal never turns into a silent bypass
            with pytest.raises(kvgate.RedisAccessDenied) as e:
                driver.call(gate.acquire, "s", prompt_tokens=10, max_new_tokens=5)
            assert f"{named} (NOPERM" in str(e.value) and "docs/deploy.md#acl" in str(e.value)
            assert isinstance(e.value.error, redis.ResponseError)
        with pytest.raises(kvgate.RedisAccessDenied):  # an operator's call (the poller's) too
            driver.call(gate.write_snapshot, engines())
    finally:
        driver.close(gate)


@pytest.mark.redis_real
def test_a_user_not_allowed_functions_runs_the_scripts_as_eval(acl_server, driver):
    # the ACL line of kvgate versions that called EVAL only: the gate falls back to it
    acl = without(documented_acl(), "+fcall", "+function|load")
    url = acl_server(acl)
    core_flow(driver, url)
    gate = driver.from_url(url, gate="acl-eval", config=config())
    try:
        driver.call(gate.acquire, "s", prompt_tokens=10, max_new_tokens=5)
        assert gate._caller.use_functions is False
    finally:
        driver.close(gate)


@pytest.mark.redis_real
def test_a_refused_publish_leaves_the_ledger_in_step_with_the_records(acl_server):
    # no channel pattern: Redis refuses a script's PUBLISH only when it publishes, here the
    # grant of a waiter, after the release freed its lease and the advance granted the head.
    # Redis keeps those writes; the ledger, written back after the body, must keep them too
    url = acl_server([a for a in documented_acl() if not a.startswith("&")])
    gate = kvgate.Gate.from_url(url, gate="acl", config=config(headroom=1.0, residency=False))
    try:
        gate.write_snapshot(engines(cap=1000))
        held = gate.acquire("a", prompt_tokens=700, max_new_tokens=100)
        waiter = script(gate, "acquire", ticket="t-b", session="b", need=600, prompt=500, probe=-2)
        assert waiter["o"] == "wait"
        with pytest.raises(kvgate.RedisAccessDenied):
            held.release()
        leases = gate.redis.hgetall(gate.key("leases"))
        assert list(leases) == [b"t-b"]  # the grant stands
        ledger_consistent(gate.redis, gate)  # reserved == the leases' and windows' charges
    finally:
        gate.close()


@pytest.mark.redis_real
def test_a_poller_without_its_lease_command_stops_with_the_refusal(acl_server):
    # no "+set": the leader lease (SET NX PX) is refused; a poller that took that for "another
    # poller leads" would stay a standby forever, writing nothing
    url = acl_server(without(documented_acl(), "+set"))
    gate = kvgate.Gate.from_url(url, gate="acl", config=config())
    try:
        with SimCluster(1, time_scale=0.0, router=False, **SMALL) as sim:
            p = Poller(gate, engines=sim.engine_urls)
            with pytest.raises(kvgate.RedisAccessDenied) as e:
                p.run(max_ticks=3)  # returns after 3 ticks if it swallowed the refusal
        assert "'set' command" in str(e.value) and "docs/deploy.md#acl" in str(e.value)
    finally:
        gate.close()
