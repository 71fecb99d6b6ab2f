"""The OpenAI-compatible HTTP server over the Conflux engine.

Modules, one job each: ``protocol`` (request schemas, request -> SamplingParams), ``app``
(routes), ``request_flow`` (one request's life: admit, stream or collect, abort, metrics),
``engine_loop`` (the thread that owns the engine), ``formatting`` (OpenAI response bodies),
``settings`` (server settings and shared state), ``metrics`` (Prometheus, vLLM names),
``auth`` (Bearer key), ``limits`` (body size), ``errors`` (OpenAI error shape), ``cli``
(``conflux-serve`` / ``python -m serving``).
"""
