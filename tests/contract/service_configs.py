"""Each service's config class, by role: what the deployment files (compose, Kubernetes) are checked against."""
from __future__ import annotations

import importlib

CONFIG_CLASSES = {
    "gateway": ("services.gateway.config", "GatewayConfig"),
    "prefill": ("services.prefill.config", "PrefillConfig"),
    "decode": ("services.decode.config", "DecodeConfig"),
    "broker": ("services.broker.config", "BrokerConfig"),
    "kvprofile": ("services.kvprofile.config", "KvProfileConfig"),
}


def config_class(role: str) -> type:
    module, name = CONFIG_CLASSES[role]
    return getattr(importlib.import_module(module), name)
