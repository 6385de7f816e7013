"""python -m services.broker [--flags]: the transfer planner.

--help lists every setting: a flag, SMARTGEN_* env or the settings file (shared/runtime/settings_file.py)."""
from services.broker.config import BrokerConfig
from shared.runtime.service import config_main, run_main

if __name__ == "__main__":
    config = config_main(BrokerConfig, "broker")
    # NOTE: the service (the model's code with it) only now: --help and --show-config answer at once
    from services.broker.service import BrokerService

    run_main(BrokerService(config))
