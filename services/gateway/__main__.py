"""python -m services.gateway [--flags]: the OpenAI-compatible API.

--help lists every setting: a flag, SMARTGEN_* env or the settings file (shared/runtime/settings_file.py)."""
from services.gateway.config import GatewayConfig
from shared.runtime.service import config_main, run_main

if __name__ == "__main__":
    config = config_main(GatewayConfig, "gateway")
    # NOTE: the service (the model's code with it) only now: --help and --show-config answer at once
    from services.gateway.service import GatewayService

    run_main(GatewayService(config))
