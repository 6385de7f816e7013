"""SmartGen's shared code, as three packages (docs/architecture.md, its dependency rule):

- `shared.runtime`: what every service runs on: settings, logging, metrics, NATS, the service and model-worker
  frame, the torch thread, and pure helpers (profiles, prefill rates, timelines, the shared arena, calibration).
- `shared.compute`: every torch thing (model, KV store, selectors, selective attention, engines); synchronous,
  never asyncio, NATS or the data plane.
- `shared.dataplane`: KV bytes between processes (TCP, RDMA, the transfer agent); never torch.
"""
__version__ = "0.1.0"
