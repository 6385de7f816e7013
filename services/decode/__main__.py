"""python -m services.decode [--flags]: a decode worker (flags and SMARTGEN_* env: see config.py)."""
from services.decode.config import DecodeConfig
from services.decode.service import DecodeService
from shared.runtime.service import service_main

if __name__ == "__main__":
    service_main(DecodeConfig, DecodeService)
