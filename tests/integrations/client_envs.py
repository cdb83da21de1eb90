"""Virtual environments for the client packages the integration tests drive (Pipecat, LiveKit, vendor SDKs).

Their pins clash with ours and with each other, so each gets its own environment under `.venvs/<env>` at
the repository root, built from `tests/integrations/requirements/<env>.txt`. An environment is rebuilt
when its requirements file (or the Python that builds it) changes: the hash of both is stored in the
environment once it is complete. Building holds a file lock per environment, so parallel pytest workers
and `make client-envs` never build the same one twice or use a half-built one.

`python tests/integrations/client_envs.py [ENV ...]` builds the named environments (all by default);
the test fixtures call `ensure_env` lazily for a plain pytest run.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS_DIR = Path(__file__).resolve().parent / "requirements"
VENVS_DIR = REPO_ROOT / ".venvs"
ENVS = ("pipecat", "livekit", "vendor-sdks")
_STAMP = "requirements.sha256"


class ClientEnvError(RuntimeError):
    """An environment could not be built (the pip output says why)."""


def requirements_file(env: str) -> Path:
    if env not in ENVS:
        raise ValueError(f"unknown client environment {env!r}; expected one of {', '.join(ENVS)}")
    return REQUIREMENTS_DIR / f"{env}.txt"


def env_python(env: str) -> Path:
    return VENVS_DIR / env / "bin" / "python"


def _fingerprint(env: str) -> str:
    digest = hashlib.sha256(requirements_file(env).read_bytes())
    # A different interpreter (version or location) needs a fresh environment, not the old one.
    digest.update(f"\0{sys.version}\0{sys.base_prefix}".encode())
    return digest.hexdigest()


@contextmanager
def _locked(env: str) -> Iterator[None]:
    VENVS_DIR.mkdir(exist_ok=True)
    with (VENVS_DIR / f"{env}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _is_current(env: str) -> bool:
    stamp = VENVS_DIR / env / _STAMP
    return env_python(env).exists() and stamp.exists() and stamp.read_text().strip() == _fingerprint(env)


def ensure_env(env: str, log: bool = False) -> Path:
    """The Python of `env`, built first if it is missing or out of date; ClientEnvError if pip fails."""
    requirements = requirements_file(env)
    with _locked(env):
        if _is_current(env):
            return env_python(env)
        target = VENVS_DIR / env
        shutil.rmtree(target, ignore_errors=True)
        started = time.monotonic()
        if log:
            print(f"building {target} from {requirements.relative_to(REPO_ROOT)} ...", flush=True)
        steps = (
            [sys.executable, "-m", "venv", str(target)],
            [str(env_python(env)), "-m", "pip", "install", "-q", "--disable-pip-version-check",
             "-r", str(requirements)],
        )
        for step in steps:
            result = subprocess.run(step, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                shutil.rmtree(target, ignore_errors=True)
                raise ClientEnvError(
                    f"building client environment {env!r} failed ({' '.join(step[:4])} ...):\n"
                    f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
                )
        # Written last: an environment without it is half-built and gets rebuilt.
        (target / _STAMP).write_text(_fingerprint(env) + "\n")
        if log:
            print(f"built {target} in {time.monotonic() - started:.0f} s", flush=True)
        return env_python(env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("envs", nargs="*", metavar="ENV", help=f"any of {', '.join(ENVS)} (default: all)")
    for env in parser.parse_args().envs or ENVS:
        try:
            ensure_env(env, log=True)
        except (ClientEnvError, ValueError) as exc:
            sys.exit(str(exc))


if __name__ == "__main__":
    main()
