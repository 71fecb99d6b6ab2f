"""The OpenAI-compatible HTTP server over the Conflux engine.

Modules, one job each: ``protocol`` (request schemas), ``app`` (routes), ``engine_loop``
(the thread that owns the engine), ``formatting`` (OpenAI response pieces), ``metrics``
(Prometheus, vLLM names), ``auth`` (Bearer key), ``limits`` (body size), ``errors``
(OpenAI error shape), ``cli`` (``conflux-serve`` / ``python -m serving``).
"""
