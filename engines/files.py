"""Files that other processes may read while they are written (caches beside the models, shared by every
replica on the models volume)."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

ASIDE_SUFFIX = ".tmp"


def write_whole(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: into a file of its own beside it, then renamed over it (a reader
    never sees half a file, and two writers of the same path never share a file). Raises OSError; the
    file aside is gone then."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=ASIDE_SUFFIX)
    aside = Path(name)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        aside.replace(path)
    except BaseException:
        aside.unlink(missing_ok=True)
        raise


def sweep_aside(folder: Path, kept_suffix: str, older_than_s: float) -> int:
    """Remove the files `write_whole` left aside for `*{kept_suffix}` files in `folder` more than
    `older_than_s` ago (a writer killed outright, which no handler could tidy after; a younger one may be
    another process's write under way). Housekeeping only: a folder this process may not change (a
    read-only volume) is left as it is. Returns how many were removed."""
    if not folder.is_dir():
        return 0
    removed = 0
    before = time.time() - older_than_s
    for aside in folder.glob(f".*{kept_suffix}.*{ASIDE_SUFFIX}"):
        try:
            if aside.stat().st_mtime < before:
                aside.unlink()
                removed += 1
        except FileNotFoundError:  # removed meanwhile by another process's sweep
            continue
        except OSError:  # read-only, or another user's file
            break
    return removed
