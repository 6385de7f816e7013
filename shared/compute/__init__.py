"""Every torch thing, in one package: the model (modeling.py), the KV store and the cache over its slabs
(kvstore.py, slab_cache.py), the KV selectors (selectors/) and selective attention (selective.py),
quantization, sampling, the prefill and decode engines, and the one torch thread that runs them.

Synchronous torch: nothing here imports NATS or aiohttp, and only torch_thread.py touches asyncio (it is the
bridge). Services run everything on their `TorchThread`; tools (benchmarks, evaluations, selector
preparation) call it directly. Remote KV is seen only through the `RemoteEntries` protocol (selective.py),
which the decode service implements over its data plane.
"""
