"""Where the released checkpoints' name/shape manifests are: `shared/reference/checkpoints` beside the
checkout (CI clones the repo next to `shared/`). Tests that need one skip, saying so, when it is absent."""

from __future__ import annotations

from pathlib import Path

import pytest

REFERENCE_DIR = Path(__file__).resolve().parents[3] / "shared" / "reference" / "checkpoints"


def reference_manifest(name: str) -> Path:
    """The path of manifest `name`; skips the calling test if the reference folder is not there."""
    path = REFERENCE_DIR / name
    if not path.is_file():
        pytest.skip(f"reference checkpoint manifest {path} not found (shared/ must sit beside the checkout)")
    return path
