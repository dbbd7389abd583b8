"""Make this CPU look older to PyTorch and vLLM: ``benchmarks/real_vllm.py --cpu-isa``.

Python imports ``sitecustomize`` at start-up from ``PYTHONPATH``; the real-vLLM bench puts this
directory there for the server (and so for its EngineCore and worker processes) when asked to
emulate an older instruction set. ``KVGATE_CPU_MASK`` names the capabilities to hide, comma
separated (keys of ``torch.cpu.get_capabilities()``, a ``*`` suffix for a prefix). vLLM reads
them through ``torch.cpu._is_*_supported()`` to pick its kernels (its AMX linear and attention
paths, its AVX-512 or AVX2 build of ``vllm._C``); oneDNN and ATen are capped by their own
variables (``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``), which the bench sets beside this.
An emulation, not another CPU: clocks, caches and memory stay this machine's.
"""
import os

_mask = [m.strip() for m in os.environ.get("KVGATE_CPU_MASK", "").split(",") if m.strip()]
if _mask:
    from types import MappingProxyType

    import torch.cpu as _tc

    _caps = dict(_tc.get_capabilities())
    for _k in list(_caps):
        if any(_k == m or (m.endswith("*") and _k.startswith(m[:-1])) for m in _mask):
            if isinstance(_caps[_k], bool):
                _caps[_k] = False
    _frozen = MappingProxyType(_caps)
    _tc.get_capabilities = lambda: _frozen  # torch.cpu._is_*_supported() read it through this name
