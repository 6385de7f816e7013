"""python -m services.kvprofile [--flags] (flags and SMARTGEN_* env: see config.py)."""
from services.kvprofile.config import KvProfileConfig
from services.kvprofile.service import KvProfileService
from shared.runtime.service import service_main

if __name__ == "__main__":
    service_main(KvProfileConfig, KvProfileService)
