"""Files that other processes may read while they are written (caches beside the models, shared by every
replica on the models volume)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_whole(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: into a file of its own beside it, then renamed over it (a reader
    never sees half a file, and two writers of the same path never share a file). Raises OSError; the
    file aside is gone then."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    aside = Path(name)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        aside.replace(path)
    except BaseException:
        aside.unlink(missing_ok=True)
        raise
