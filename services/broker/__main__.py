"""python -m services.broker [--flags] (flags and SMARTGEN_* env: see config.py)."""
from services.broker.config import BrokerConfig
from services.broker.service import BrokerService
from shared.runtime.service import service_main

if __name__ == "__main__":
    service_main(BrokerConfig, BrokerService)
