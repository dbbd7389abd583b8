"""SGLang engine + router SIMULATOR for kvgate's tests and benchmarks.

SGLang does not run on CPU, so kvgate carries a simulator that speaks SGLang's
HTTP surface (``/generate``, ``/abort_request``, ``/close_session``,
``/metrics``, ...) over real HTTP on loopback, with a block-level prefix-cache
model and a cost model from a profile.  It is a simulator, not SGLang: see
docs/simulator.md for what is modelled and what is not.

    from kvgate.tools.sim import SimCluster
    with SimCluster(2, "gpu-h100-30b", time_scale=0.05) as sim:
        sim.router_url, sim.engine_urls, sim.engines[0], sim.stop_engine(1)
"""
from .cache import PrefixCache, block_hashes
from .client import HttpPool
from .cluster import SimCluster
from .engine import SimEngine
from .http import build_engine_app
from .profile import DEFAULT_PROFILE, Profile, available_profiles, load_profile
from .router import SimRouter
from .scheduler import RankScheduler, Req, output_tokens

__all__ = [
    "DEFAULT_PROFILE", "HttpPool", "PrefixCache", "Profile", "RankScheduler", "Req", "SimCluster",
    "SimEngine", "SimRouter", "available_profiles", "block_hashes", "build_engine_app",
    "load_profile", "output_tokens",
]
