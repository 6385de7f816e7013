"""A prepared model is readable by users other than the one who prepared it (an image's non-root user)."""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from shared.runtime.models import readable_as_umask_allows


def test_a_staged_model_folder_gets_the_modes_a_plain_mkdir_and_open_give(tmp_path):
    """mkdtemp's 0700 folder and safetensors' 0600 files become 0755 and 0644 under umask 022 (nothing wider
    than the umask allows: 0750 and 0640 under 027)."""
    for umask, folder_mode, file_mode in ((0o022, 0o755, 0o644), (0o027, 0o750, 0o640)):
        staging = Path(tempfile.mkdtemp(dir=tmp_path))
        (staging / "sub").mkdir(mode=0o700)
        for name in ("model.safetensors", "sub/hata.safetensors"):
            (staging / name).write_bytes(b"x")
            (staging / name).chmod(0o600)
        old = os.umask(umask)
        try:
            readable_as_umask_allows(staging)
        finally:
            os.umask(old)
        assert stat.S_IMODE(staging.stat().st_mode) == stat.S_IMODE((staging / "sub").stat().st_mode) == folder_mode
        assert {stat.S_IMODE((staging / n).stat().st_mode) for n in ("model.safetensors", "sub/hata.safetensors")} \
            == {file_mode}


def test_a_single_prepared_file_too(tmp_path):
    """The selectors' preparation files, written one by one beside a model."""
    path = tmp_path / "infinigen.safetensors"
    path.write_bytes(b"x")
    path.chmod(0o600)
    old = os.umask(0o022)
    try:
        readable_as_umask_allows(path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
