"""The run time every service shares: settings (config.py), logging, metrics, the NATS connection and service
runner (natsconn.py, service.py, rpc.py, registry.py), the model worker's frame (worker.py), admin auth, and the
pure helpers the services and tools agree on (models.py, profiles.py, prefill_rate.py, timeline.py, arena.py,
calibration.py).

The dependency rule (docs/architecture.md, its dependency rule): compute (torch) imports only this package's pure leaves
(arena, profiles, models), never asyncio or the data plane; the data plane imports no torch."""
