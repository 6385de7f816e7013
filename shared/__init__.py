"""SmartGen's common runtime: config, logging, metrics, the NATS service runner, the KV store and the data plane."""
__version__ = "0.1.0"
