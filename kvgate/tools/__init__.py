"""Tools, not the gate: the benchmark, the SGLang engine simulator and real-engine test helpers.

They need the ``bench`` extra (``pip install 'kvgate[bench]'``); nothing in the gate imports them."""
