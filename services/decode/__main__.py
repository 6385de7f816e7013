"""python -m services.decode [--flags]: a decode worker.

--help lists every setting: a flag, SMARTGEN_* env or the settings file (shared/runtime/settings_file.py)."""
from services.decode.config import DecodeConfig
from shared.runtime.service import config_main, run_main

if __name__ == "__main__":
    config = config_main(DecodeConfig, "decode")
    # NOTE: the service (the model's code with it) only now: --help and --show-config answer at once
    from services.decode.service import DecodeService

    run_main(DecodeService(config))
