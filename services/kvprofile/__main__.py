"""python -m services.kvprofile [--flags]: the KV importance profiles.

--help lists every setting: a flag, SMARTGEN_* env or the settings file (shared/runtime/settings_file.py)."""
from services.kvprofile.config import KvProfileConfig
from shared.runtime.service import config_main, run_main

if __name__ == "__main__":
    config = config_main(KvProfileConfig, "kvprofile")
    # NOTE: the service (the model's code with it) only now: --help and --show-config answer at once
    from services.kvprofile.service import KvProfileService

    run_main(KvProfileService(config))
