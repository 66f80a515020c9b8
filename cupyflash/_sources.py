"""Where the CUDA sources live, and the hash that keys every compiled variant."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

_SUFFIXES = (".cu", ".cuh")


def kernels_dir() -> Path:
    """Return the directory holding the ``.cu``/``.cuh`` kernel sources.

    An installed wheel carries them inside the package (``cupyflash/kernels_cu``);
    a source checkout or editable install finds them at the repository's top level.
    """
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels_cu", here.parent / "kernels_cu"):
        if (candidate / "flash_fwd.cu").is_file():
            return candidate
    raise FileNotFoundError(
        "cupyflash: kernel sources not found; looked for flash_fwd.cu in "
        f"{here / 'kernels_cu'} and {here.parent / 'kernels_cu'}"
    )


@functools.lru_cache(maxsize=None)
def sources_hash() -> str:
    """SHA-256 over the names and bytes of every file in :func:`kernels_dir`."""
    h = hashlib.sha256()
    root = kernels_dir()
    for path in sorted(p for p in root.iterdir() if p.suffix in _SUFFIXES):
        h.update(path.name.encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()
