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

When that folder is new, `keep_bytecode` first compiles the largest packages a start imports, whole, in
as many processes as there are cores (`compile_packages`): importing compiles one module at a time in
the main process (and again in every compile worker that imports before it is written), ~17 s of a cold
start on the GPU bench image, while the six packages compiled whole took 3.6–4.0 s of its 16 cores
(H200 cold start 72.5 -> 55.1 s; docs/benchmarks.md, twenty-eighth session).
"""

from __future__ import annotations

import compileall
import importlib.util
import logging
import multiprocessing
import os
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

logger = logging.getLogger(__name__)

# The packages most of a start's imported modules come from (a CPU start: ~2900 modules, 1289 of torch, 420
# of sympy, 285 of networkx, 87 of numpy, 51 of mpmath; Inductor brings triton's on a GPU). The rest
# (the standard library, the service's own small dependencies) compile as they are imported.
LARGE_PACKAGES = ("torch", "sympy", "networkx", "numpy", "mpmath", "triton")


def keep_bytecode(directory: Path, package: str = "torch",
                  precompile: Iterable[str] = LARGE_PACKAGES) -> Path | None:
    """Cache bytecode under `directory` if `package` (not imported yet) comes without any; returns the
    folder, or None when the installation has bytecode, a prefix is set already or `directory` cannot
    be created. Writing there is allowed even under PYTHONDONTWRITEBYTECODE, which keeps files out of
    the installation, not out of a cache of our own. Where the folder holds no bytecode of `package`
    yet, the packages `precompile` names are compiled into it first (`compile_packages`; ~140 MB for the
    six of LARGE_PACKAGES), unless that fails (logged: the imports then compile what they need)."""
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
    if not Path(importlib.util.cache_from_source(spec.origin)).is_file():
        try:
            compile_packages(precompile)
        except Exception as exc:  # only a head start: the imports compile what they need
            logger.warning("bytecode not compiled ahead (%s: %s); modules compile as they are imported",
                           type(exc).__name__, exc)
    return directory


def compile_packages(packages: Iterable[str], workers: int | None = None) -> None:
    """Compile the whole source tree of each installed package of `packages` into the bytecode cache now
    in use (`sys.pycache_prefix`, and the environment's PYTHONPYCACHEPREFIX for the worker processes), in
    one pool of `workers` processes (default: one per core this process may run on) over all their
    files (a pool per package took ~20 % longer on 2 cores). A file that does not compile is left to the
    import."""
    started = time.perf_counter()
    sources: list[str] = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            for folder in spec.submodule_search_locations:
                sources.extend(str(path) for path in Path(folder).rglob("*.py"))
    # Fresh interpreters (the caller may have threads, so no fork), and no forkserver left running for
    # the service's lifetime: the workers end with the pool.
    context = multiprocessing.get_context("spawn")
    workers = workers or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None)
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        written = sum(pool.map(_compile_quietly, sources, chunksize=64))
    logger.info("bytecode of %d modules in %.1f s (%d left to their import)", len(sources),
                time.perf_counter() - started, len(sources) - written)


def _compile_quietly(source: str) -> bool:
    """Whether `source`'s bytecode is in the cache now (written, or up to date already)."""
    return bool(compileall.compile_file(source, quiet=2))
