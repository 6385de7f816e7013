"""Every torch thing, in one package: the model (modeling.py), the KV store and the cache over its slabs
(kvstore.py, slab_cache.py), the KV selectors (selectors/) and selective attention (selective.py),
quantization, sampling, and the prefill and decode engines.

Synchronous torch: nothing here imports NATS, aiohttp, asyncio or the data plane, even indirectly
(tests/contract/test_layering.py). Services run everything on their `TorchThread` (shared/runtime/torch_thread.py);
tools (benchmarks, evaluations, selector preparation) call it directly. Remote KV is seen only through the `RemoteEntries` protocol (remote_entries.py),
which the decode service implements over its data plane.
"""
