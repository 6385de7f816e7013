"""python -m services.prefill [--flags]: a prefill worker.

--help lists every setting: a flag, SMARTGEN_* env or the settings file (shared/runtime/settings_file.py)."""
from services.prefill.config import PrefillConfig
from shared.runtime.service import config_main, run_main

if __name__ == "__main__":
    config = config_main(PrefillConfig, "prefill")
    # NOTE: the service (the model's code with it) only now: --help and --show-config answer at once
    from services.prefill.service import PrefillService

    run_main(PrefillService(config))
