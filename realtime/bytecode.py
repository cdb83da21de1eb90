"""Python bytecode kept beside the models when the installation has none.

An installation without `.pyc` files (some package managers do not compile them, and images often set
PYTHONDONTWRITEBYTECODE or mount the installation read-only) makes every process compile torch's
modules from source again: on the GPU bench image ~1400 modules, ~6 s of each start (`torch.compile`
alone pulls in Dynamo, Inductor and sympy). `keep_bytecode` points Python's bytecode cache
(`sys.pycache_prefix`) at a folder beside the models instead, so a restart reads what the first start
wrote. It must run before the heavy imports, and only when the installation lacks bytecode: with a
prefix Python no longer reads the `__pycache__` folders next to the sources. The processes the service
spawns (a cold start's compile workers, which import Dynamo and Inductor) inherit the folder through
the environment: they read what the parent or a sibling wrote instead of compiling it again.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path


def keep_bytecode(directory: Path, package: str = "torch") -> Path | None:
    """Cache bytecode under `directory` if `package` (not imported yet) comes without any; returns the
    folder, or None when the installation has bytecode, a prefix is set already or `directory` cannot
    be created. Writing there is allowed even under PYTHONDONTWRITEBYTECODE, which keeps files out of
    the installation, not out of a cache of our own."""
    spec = importlib.util.find_spec(package)
    if sys.pycache_prefix is not None or spec is None or spec.origin is None:
        return None
    if Path(importlib.util.cache_from_source(spec.origin)).is_file():
        return None
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    sys.pycache_prefix = str(directory)
    sys.dont_write_bytecode = False
    os.environ["PYTHONPYCACHEPREFIX"] = str(directory)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return directory
