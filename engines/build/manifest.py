"""`realtime-manifest.json`: the record that a models directory is complete.

It is written last by every build, after all files are in place, so a directory without it (or with one
whose files no longer match) is never taken as complete. It lists each file with its size and sha256.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import platform
from pathlib import Path
from typing import Any

import torch

from engines.checkpoints import CheckpointError
from engines.config import MANIFEST_NAME, ModelSize, read_manifest

MANIFEST_FORMAT = 1
HASH_BLOCK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(
    root: Path, size: ModelSize, source: str, files: list[Path], **info: Any
) -> dict[str, Any]:
    """Write the manifest for `files` (paths under `root`) atomically; extra `info` goes into `created`."""
    root = Path(root)
    entries = []
    for path in sorted(files):
        entries.append({
            "path": path.relative_to(root).as_posix(),
            "bytes": path.stat().st_size,
            "sha256": sha256_file(path),
        })
    manifest = {
        "format": MANIFEST_FORMAT,
        "size": size,
        "source": source,
        "created": {
            "at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "by": "scripts/build_engines.py",
            "python": platform.python_version(),
            "torch": torch.__version__,
            **info,
        },
        "files": entries,
    }
    tmp = root / (MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(root / MANIFEST_NAME)
    return manifest


def check_manifest(root: Path, size: ModelSize | None = None, hashes: bool = True) -> dict[str, Any]:
    """The manifest of `root` if every file it lists is present and unchanged, else CheckpointError.

    `size` (when given) must match; `hashes=False` compares sizes only (fast for full checkpoints).
    """
    root = Path(root)
    try:
        manifest = read_manifest(root)
    except (FileNotFoundError, ValueError) as exc:
        raise CheckpointError(str(exc)) from exc
    if size is not None and manifest.get("size") != size:
        raise CheckpointError(f"{root} holds size {manifest.get('size')!r} models, not {size!r}")
    entries = manifest.get("files")
    if not isinstance(entries, list) or not entries:
        raise CheckpointError(f"{root / MANIFEST_NAME} lists no files")
    for entry in entries:
        path = root / entry["path"]
        if not path.is_file():
            raise CheckpointError(f"{path} is listed in the manifest but missing")
        actual = path.stat().st_size
        if actual != entry["bytes"]:
            raise CheckpointError(f"{path} has {actual} bytes, the manifest says {entry['bytes']}")
        if hashes and sha256_file(path) != entry["sha256"]:
            raise CheckpointError(f"{path} changed since the manifest was written (sha256 differs)")
    return manifest


def remove_manifest(root: Path) -> None:
    """Mark `root` incomplete before changing any of its files."""
    (Path(root) / MANIFEST_NAME).unlink(missing_ok=True)
