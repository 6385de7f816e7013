"""python -m services.gateway [--flags]: the OpenAI-compatible API (flags and SMARTGEN_* env: see config.py)."""
from services.gateway.config import GatewayConfig
from services.gateway.service import GatewayService
from shared.runtime.service import service_main

if __name__ == "__main__":
    service_main(GatewayConfig, GatewayService)
