"""``python -m kvgate.tools.sim``: serve simulated SGLang engines + a router until Ctrl-C.

Example::

    python -m kvgate.tools.sim --engines 2 --profile gpu-h100-30b --port 30000 --time-scale 0.05

Engines listen on ``--port``, ``--port+1``, ...; the router on ``--router-port``
(default: the port after the last engine).  ``--port 0`` picks free ports.  The
URLs are printed as one JSON line on stdout (and written to ``--ready-file``).
This is a simulator, not SGLang.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from .cluster import LOOPBACK, SimCluster
from .profile import DEFAULT_PROFILE, available_profiles


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kvgate.tools.sim",
                                 description="SGLang engine + router SIMULATOR (not SGLang).")
    ap.add_argument("--engines", type=int, default=2, help="number of simulated engines")
    ap.add_argument("--profile", default=DEFAULT_PROFILE,
                    help=f"profile name ({', '.join(available_profiles())}) or path to a .json")
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="multiplier on engine time (0.05 = 20x faster than real time, 0 = no sleeping)")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--dp-size", type=int, default=1)
    ap.add_argument("--prefill-metrics", action="store_true",
                    help="SIMULATOR ONLY: export kvgate_sim:prefill_seconds_total, a prefill time SGLang "
                         "does not export, so the poller measures a prefill cost as on vLLM")
    ap.add_argument("--enable-session-radix-cache", action="store_true",
                    help="pin open sessions' KV until /close_session (SGLang --enable-session-radix-cache)")
    ap.add_argument("--kv-capacity-tokens", type=int, default=None, help="override the profile's pool size")
    ap.add_argument("--block-size", type=int, default=None, help="override the profile's block size")
    ap.add_argument("--host", default=LOOPBACK, help="address to bind (default loopback)")
    ap.add_argument("--advertise-host", default=None,
                    help="host name used in the printed URLs and the router's /workers "
                         "(default: --host; set it when binding 0.0.0.0)")
    ap.add_argument("--port", type=int, default=30000, help="first engine port (0 = free ports)")
    ap.add_argument("--router-port", type=int, default=None)
    ap.add_argument("--no-router", action="store_true")
    ap.add_argument("--no-workers-endpoint", action="store_true",
                    help="router answers 404 on /workers (an older router; /list_workers only)")
    ap.add_argument("--health-check-interval", type=float, default=1.0,
                    help="router health-check period in seconds (0 = off)")
    ap.add_argument("--ready-file", default=None, help="write the URLs as JSON here once serving")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    overrides = {}
    if args.kv_capacity_tokens is not None:
        overrides["kv_capacity_tokens"] = args.kv_capacity_tokens
    if args.block_size is not None:
        overrides["block_size"] = args.block_size
    try:
        cluster = SimCluster(args.engines, args.profile, time_scale=args.time_scale,
                             tp_size=args.tp_size, dp_size=args.dp_size,
                             session_radix_cache=args.enable_session_radix_cache,
                             router=not args.no_router, workers_endpoint=not args.no_workers_endpoint,
                             health_check_interval_s=args.health_check_interval or None,
                             host=args.host, base_port=args.port, router_port=args.router_port,
                             advertise_host=args.advertise_host, prefill_metrics=args.prefill_metrics,
                             **overrides)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *a: stop.set())
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    cluster.start()
    try:
        info = {"engines": cluster.engine_urls, "router": cluster.router_url,
                "profile": cluster.profile.name, "simulator": True}
        if args.ready_file:
            tmp = args.ready_file + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(info, f)
            os.replace(tmp, args.ready_file)
        print(json.dumps(info), flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
