"""The ``kvgate`` command: ``poller``, ``status``, ``top``, ``bench``.

Every GateConfig knob is a flag (``--max-wait-s 10``, ``--admission/--no-admission``) and a
``KVGATE_*`` environment variable; flags override the environment, which overrides defaults
(``kvgate.knob_flags``, which ``kvgate bench`` uses too).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time
from typing import Sequence

from .knob_flags import add_knob_arguments, config_from_args

__all__ = ["main", "build_parser", "add_knob_arguments", "config_from_args", "add_connection_arguments"]


# -- connection and value flags -------------------------------------------------------------
def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis", metavar="URL", default=os.environ.get("KVGATE_REDIS_URL"),
                        help="Redis URL (env KVGATE_REDIS_URL), e.g. redis://127.0.0.1:6379/0")
    parser.add_argument("--gate", metavar="NAME", default=os.environ.get("KVGATE_GATE"),
                        help="gate name (env KVGATE_GATE)")


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"must be > 0: {s!r}")
    return v


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {s!r}")
    return v


def _port(s: str) -> int:
    v = _positive_int(s)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {s!r}")
    return v


# -- parser --------------------------------------------------------------------------------
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def build_parser(*, with_bench: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgate", description="Redis-backed KV admission gate for SGLang / vLLM")
    # str.upper also applies to the default: KVGATE_LOG_LEVEL=info is INFO; argparse checks
    # choices only for a flag given, so main() checks the value from the environment
    p.add_argument("--log-level", type=str.upper, default=os.environ.get("KVGATE_LOG_LEVEL", "INFO"),
                   choices=LOG_LEVELS)
    sub = p.add_subparsers(dest="command", metavar="{poller,status,top,bench}")
    sub.required = True

    sp = sub.add_parser("poller", help="discover engines, scrape /metrics, write snapshots (leader-elected)")
    add_connection_arguments(sp)
    src = sp.add_mutually_exclusive_group()
    src.add_argument("--router", metavar="URL", help="sgl-router base URL (GET /workers, /list_workers)")
    src.add_argument("--engine", metavar="URL", action="append", help="engine base URL (repeatable)")
    # the poller's own settings: default None, so cmd_poller can tell a flag from
    # KVGATE_POLLER_* (flags win over the environment, which wins over the defaults)
    def penv(dest: str) -> str:
        var, _conv, default = POLLER_ENV[dest]
        return f"(default {default}; env {var})"

    sp.add_argument("--interval", type=_positive_float, default=None, metavar="S",
                    help="seconds between ticks; must be below --staleness-s " + penv("interval"))
    sp.add_argument("--http-timeout", type=_positive_float, default=None, metavar="S",
                    help="deadline of each router / engine request " + penv("http_timeout"))
    sp.add_argument("--max-body-bytes", type=_positive_int, default=None, metavar="N",
                    help="stop reading a response past N bytes " + penv("max_body_bytes"))
    sp.add_argument("--leader-ttl", type=_positive_float, default=None, metavar="S",
                    help="leader lease TTL; a standby takes over within about this long " + penv("leader_ttl"))
    sp.add_argument("--concurrency", type=_positive_int, default=None, metavar="N",
                    help="engines scraped at once " + penv("concurrency"))
    sp.add_argument("--housekeep-limit", type=_positive_int, default=None, metavar="N",
                    help="bound on the work of each housekeeping call " + penv("housekeep_limit"))
    sp.add_argument("--unhealthy-after", type=_positive_int, default=None, metavar="N",
                    help="failed scrapes in a row before an engine the router lists as healthy counts "
                         "as unhealthy (until then its last usable numbers stand; 1 = at once) "
                         + penv("unhealthy_after"))
    sp.add_argument("--metrics-port", type=_port, default=None, metavar="P",
                    help="serve the gate's Prometheus metrics on this port")
    sp.add_argument("--metrics-host", default="127.0.0.1", metavar="ADDR",
                    help="bind address of the metrics endpoint (0.0.0.0 in containers)")
    sp.add_argument("--dry-run", action="store_true",
                    help="discover and scrape once, print what would be written, touch nothing in Redis")
    sp.add_argument("--max-ticks", type=_positive_int, default=None, help=argparse.SUPPRESS)
    add_knob_arguments(sp)

    st = sub.add_parser("status", help="print the gate's state once")
    add_connection_arguments(st)
    st.add_argument("--json", action="store_true", help="machine-readable output")
    add_knob_arguments(st)

    tp = sub.add_parser("top", help="live view of the gate, refreshed every --refresh seconds")
    add_connection_arguments(tp)
    tp.add_argument("--refresh", type=_positive_float, default=1.0, metavar="S")
    tp.add_argument("--iterations", type=_positive_int, default=None, metavar="N",
                    help="stop after N refreshes (default: until Ctrl-C)")
    add_knob_arguments(tp)

    bp = sub.add_parser("bench", help="benchmarks (kvgate.tools.bench)")
    if with_bench:
        try:
            from kvgate.tools.bench import cli as bench_cli
        except ImportError as e:
            bp.set_defaults(_bench_missing=str(e))
            bp.add_argument("rest", nargs=argparse.REMAINDER)
        else:
            bench_cli.add_arguments(bp)
            bp.set_defaults(_bench_run=bench_cli.run)
    else:
        bp.add_argument("rest", nargs=argparse.REMAINDER)
    return p


# -- commands ------------------------------------------------------------------------------
def _need_connection(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.redis:
        parser.error(f"{args.command}: --redis URL is required (or set KVGATE_REDIS_URL)")
    if not args.gate:
        parser.error(f"{args.command}: --gate NAME is required (or set KVGATE_GATE)")


def _open_gate(args: argparse.Namespace, cfg, parser: argparse.ArgumentParser | None = None):
    import kvgate

    try:
        return kvgate.Gate.from_url(args.redis, gate=args.gate, config=cfg)
    except ValueError as e:  # malformed URL
        if parser is None:
            raise
        parser.error(f"--redis {args.redis!r}: {e}")


def _leader_of(gate, name: str) -> str | None:
    from kvgate.control.lease import leader_key

    try:
        v = gate.redis.get(leader_key(name))
    except Exception:  # noqa: BLE001 - display only
        return None
    if v is None:
        return ""
    return v.decode() if isinstance(v, bytes) else str(v)


#: the poller's own settings (not GateConfig knobs): argparse dest -> (environment variable,
#: parser, default). A flag wins over the variable, the variable over the default.
POLLER_ENV = {
    "interval": ("KVGATE_POLLER_INTERVAL_S", _positive_float, 1.0),
    "http_timeout": ("KVGATE_POLLER_HTTP_TIMEOUT_S", _positive_float, 2.0),
    "max_body_bytes": ("KVGATE_POLLER_MAX_BODY_BYTES", _positive_int, 8 * 1024 * 1024),
    "leader_ttl": ("KVGATE_POLLER_LEADER_TTL_S", _positive_float, 5.0),
    "concurrency": ("KVGATE_POLLER_CONCURRENCY", _positive_int, 32),
    "housekeep_limit": ("KVGATE_POLLER_HOUSEKEEP_LIMIT", _positive_int, 100),
    "unhealthy_after": ("KVGATE_POLLER_UNHEALTHY_AFTER", _positive_int, 2),
}


def cmd_poller(parser, args, cfg) -> int:
    from kvgate import errors as kvgate_errors
    from kvgate.control.poller import Poller

    if not args.router and not args.engine:
        parser.error("poller: give --router URL or at least one --engine URL")
    for dest, (var, conv, default) in POLLER_ENV.items():
        if getattr(args, dest) is not None:
            continue  # given as a flag
        raw = os.environ.get(var)
        try:
            setattr(args, dest, default if raw is None else conv(raw.strip()))
        except argparse.ArgumentTypeError as e:
            parser.error(f"poller: {var}={raw!r}: {e}")
    gate = _open_gate(args, cfg, parser)
    try:
        poller = Poller(gate, router=args.router, engines=args.engine, interval_s=args.interval,
                        http_timeout_s=args.http_timeout, max_body_bytes=args.max_body_bytes,
                        leader_ttl_s=args.leader_ttl, concurrency=args.concurrency,
                        housekeep_limit=args.housekeep_limit, unhealthy_after=args.unhealthy_after)
    except ValueError as e:
        parser.error(f"poller: {e}")
    if args.dry_run:
        return _dry_run(poller)
    if args.metrics_port:
        try:
            _serve_metrics(gate, poller, args.metrics_host, args.metrics_port)
        except OSError as e:
            print(f"kvgate poller: cannot serve metrics on {args.metrics_host}:{args.metrics_port}: {e}",
                  file=sys.stderr)
            return 1

    def _stop(signum, _frame):
        logging.getLogger("kvgate.control.poller").info("signal %s: stopping", signum)
        poller.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    logging.getLogger("kvgate.control.poller").info(
        "poller %s for gate %s (%s), interval %.2fs, leader ttl %.1fs, http timeout %.1fs, concurrency %d",
        poller.identity, poller.name, args.router or ",".join(args.engine), poller.interval_s,
        poller.leader_ttl_s, poller.http_timeout_s, poller.concurrency)
    try:
        poller.run(max_ticks=args.max_ticks)
    except kvgate_errors.RedisAccessDenied as e:  # a configuration error: one line, not a trace
        print(f"kvgate poller: {e}", file=sys.stderr)
        return 1
    return 0


def _dry_run(poller) -> int:
    import json

    res = poller.observe()
    out = {
        "source": poller.discovery.last_source,
        "discovery_error": res.discovery_error,
        "would_write": bool(res.states) and any(s.healthy for s in res.states),
        "reason": res.reason or None,
        "engines": [dict(s.to_script(), engine_id=s.engine_id) for s in res.states],
        "errors": res.errors,
        "seconds": round(res.seconds, 3),
    }
    print(json.dumps(out, indent=2, sort_keys=True))
    return 0 if out["would_write"] else 1


def _serve_metrics(gate, poller, host: str, port: int) -> None:
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.core import GaugeMetricFamily, CounterMetricFamily

    registry = CollectorRegistry(auto_describe=False)
    try:
        from kvgate.client.metrics import GateCollector
    except ImportError as e:
        logging.getLogger("kvgate.control.poller").warning("kvgate.client.metrics.GateCollector unavailable: %s", e)
    else:
        registry.register(GateCollector(gate))

    class PollerCollector:
        def collect(self):
            st = poller.status()
            lab = ["gate", "identity"]
            g = GaugeMetricFamily("kvgate_poller_leader", "1 when this poller holds the leader lease", labels=lab)
            g.add_metric([poller.name, poller.identity], 1.0 if st["leader"] else 0.0)
            yield g
            for name, doc in (("ticks", "poller ticks"), ("writes", "snapshots written"),
                              ("scrape_errors", "engine scrapes that failed or returned garbage"),
                              ("scrapes_bridged", "failed scrapes whose engine kept its last usable "
                                                  "numbers (fewer than --unhealthy-after in a row)"),
                              ("leader_changes", "times this poller gained or lost the lease")):
                c = CounterMetricFamily(f"kvgate_poller_{name}", doc, labels=lab)
                c.add_metric([poller.name, poller.identity], float(st[name]))
                yield c

    registry.register(PollerCollector())
    start_http_server(port, addr=host, registry=registry)


def cmd_status(parser, args, cfg) -> int:
    from kvgate.control.status import have_rich, render_status, render_status_text, status_json

    gate = _open_gate(args, cfg, parser)
    try:
        st = gate.status()
    except Exception as e:  # noqa: BLE001 - report, do not trace
        print(f"kvgate status: cannot read gate {args.gate!r} at {args.redis}: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 1
    leader = _leader_of(gate, args.gate)
    if args.json:
        out = dict(st)
        out["poller_leader"] = leader or None
        print(status_json(out))
    elif have_rich():
        from rich.console import Console

        # piped output (logs, CI) gets a wide fixed width so URLs stay on one line
        console = Console() if sys.stdout.isatty() else Console(width=160)
        console.print(render_status(st, leader=leader))
    else:  # the runtime install has no rich: the same rows as plain text
        print(render_status_text(st, leader=leader))
    return 0


def cmd_top(parser, args, cfg) -> int:
    from kvgate.control.status import have_rich, render_status, render_status_text

    gate = _open_gate(args, cfg, parser)
    rich = have_rich()

    def frame():
        try:
            st = gate.status()
        except Exception as e:  # noqa: BLE001 - keep refreshing; Redis may come back
            msg = f"cannot read gate {args.gate!r}: {type(e).__name__}: {e}"
            if not rich:
                return msg
            from rich.text import Text

            return Text(msg, style="bold red")
        render = render_status if rich else render_status_text
        return render(st, leader=_leader_of(gate, args.gate),
                      title=f"kvgate top {args.gate}  {time.strftime('%H:%M:%S')}")

    try:
        with _frames(rich) as show:
            show(frame())
            n = 1
            while args.iterations is None or n < args.iterations:
                time.sleep(args.refresh)
                show(frame())
                n += 1
    except KeyboardInterrupt:
        pass
    return 0


@contextlib.contextmanager
def _frames(rich: bool):
    """Yield ``show(frame)`` for ``kvgate top``: a rich Live view that redraws in place, or
    without rich plain text, the screen cleared before each frame on a terminal."""
    if rich:
        from rich.console import Console
        from rich.live import Live

        with Live(console=Console(), refresh_per_second=4, auto_refresh=False) as live:
            yield lambda f: live.update(f, refresh=True)
        return
    clear = "\x1b[2J\x1b[H" if sys.stdout.isatty() else ""

    def show(f: str) -> None:
        print(clear + f, flush=True)

    yield show


def cmd_bench(parser, args, cfg) -> int:
    from kvgate.tools import BENCH_INSTALL

    missing = getattr(args, "_bench_missing", None)
    run = getattr(args, "_bench_run", None)
    if run is None:
        print("kvgate bench: the benchmark module kvgate.tools.bench.cli is not available"
              + (f" ({missing})" if missing else "") + f"; {BENCH_INSTALL}", file=sys.stderr)
        return 2
    return int(run(args) or 0)


def _command_of(argv: Sequence[str]) -> str | None:
    it = iter(argv)
    for a in it:
        if a == "--log-level":
            next(it, None)
        elif not a.startswith("-"):
            return a
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    with_bench = _command_of(argv) == "bench"
    if with_bench:
        try:
            from kvgate.tools.bench import cli as _bench_cli  # noqa: F401
        except ImportError as e:
            from kvgate.tools import BENCH_INSTALL

            print(f"kvgate bench: the benchmark module kvgate.tools.bench.cli is not available ({e}); "
                  f"{BENCH_INSTALL}", file=sys.stderr)
            return 2
    parser = build_parser(with_bench=with_bench)
    args = parser.parse_args(argv)
    if args.log_level not in LOG_LEVELS:
        parser.error(f"KVGATE_LOG_LEVEL={os.environ.get('KVGATE_LOG_LEVEL')!r}: "
                     f"expected one of {', '.join(LOG_LEVELS)}")
    logging.basicConfig(level=getattr(logging, args.log_level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: thousands of lines per poller minute or bench run
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.command == "bench":
        return cmd_bench(parser, args, None)
    _need_connection(parser, args)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    try:
        from kvgate.keys import validate_gate_name

        validate_gate_name(args.gate)
    except ValueError as e:
        parser.error(str(e))
    handler = {"poller": cmd_poller, "status": cmd_status, "top": cmd_top}[args.command]
    return handler(parser, args, cfg)


if __name__ == "__main__":
    sys.exit(main())
