"""Engine integrations: the vLLM plugin (EngineCore utility methods + HTTP routes) and probe clients.

- `kvgate.integrations.vllm_plugin`: loaded by vLLM itself through the `vllm.general_plugins` and
  `vllm.endpoint_plugins` entry points (select it with `VLLM_PLUGINS=kvgate`).
- `kvgate.integrations.vllm.InProcessVllmProbe`: residency probe for code that holds a vLLM `AsyncLLM`/`LLM`.
- `kvgate.integrations.http_probe.HttpProbe`: residency probe over `POST /kvgate/probe` (vLLM plugin route or
  the SGLang simulator's identical route).

Nothing here imports vLLM at module import time.
"""
