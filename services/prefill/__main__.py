"""python -m services.prefill [--flags]: a prefill worker (flags and SMARTGEN_* env: see config.py)."""
from services.prefill.config import PrefillConfig
from services.prefill.service import PrefillService
from shared.runtime.service import service_main

if __name__ == "__main__":
    service_main(PrefillConfig, PrefillService)
