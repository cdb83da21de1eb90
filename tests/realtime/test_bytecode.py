"""keep_bytecode: a bytecode cache beside the models only for an installation without bytecode."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from realtime.bytecode import keep_bytecode


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A package `bytecode_probe` on sys.path, without bytecode; Python's own settings restored after."""
    source = tmp_path / "site" / "bytecode_probe" / "__init__.py"
    source.parent.mkdir(parents=True)
    source.write_text("VALUE = 1\n")
    (source.parent / "part.py").write_text("PART = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in ("bytecode_probe", "bytecode_probe.part"):  # imported by an earlier test: import anew
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", "unset")  # recorded, so that teardown restores it
    monkeypatch.delenv("PYTHONPYCACHEPREFIX")
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")  # as images often set it
    importlib.invalidate_caches()
    return source


def test_an_installation_without_bytecode_caches_it_beside_the_models(package: Path, tmp_path: Path) -> None:
    cache = tmp_path / "models" / "compile-cache" / "bytecode"
    assert keep_bytecode(cache, "bytecode_probe", precompile=()) == cache
    assert sys.pycache_prefix == str(cache) and not sys.dont_write_bytecode
    assert cache.is_dir()
    # A process the service spawns (compile workers) reads and writes the same folder.
    probe = "import sys; print(sys.pycache_prefix, sys.dont_write_bytecode)"
    child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert child.stdout.split() == [str(cache), "False"]


def test_an_installation_with_bytecode_keeps_its_own(package: Path, tmp_path: Path) -> None:
    compiled = Path(importlib.util.cache_from_source(str(package)))
    compiled.parent.mkdir()
    compiled.write_bytes(b"")
    assert keep_bytecode(tmp_path / "cache", "bytecode_probe") is None
    assert sys.pycache_prefix is None and sys.dont_write_bytecode
    assert "PYTHONPYCACHEPREFIX" not in os.environ


def test_a_prefix_chosen_already_stays(package: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "chosen"))
    assert keep_bytecode(tmp_path / "cache", "bytecode_probe") is None
    assert sys.pycache_prefix == str(tmp_path / "chosen")


def test_a_new_cache_holds_the_large_packages_before_their_import(package: Path, tmp_path: Path) -> None:
    """A first start compiles the named packages whole, in worker processes, into the new folder; a start
    that finds them there compiles nothing again."""
    cache = tmp_path / "cache"
    assert keep_bytecode(cache, "bytecode_probe", precompile=("bytecode_probe", "no_such_package")) == cache
    compiled = [Path(importlib.util.cache_from_source(str(source)))
                for source in (package, package.parent / "part.py")]
    assert all(path.is_file() and path.is_relative_to(cache) for path in compiled)
    assert "bytecode_probe" not in sys.modules
    assert not [command for command in child_commands() if "spawn_main" in command or "forkserver" in command]
    written = [path.stat().st_mtime_ns for path in compiled]
    sys.pycache_prefix = None
    assert keep_bytecode(cache, "bytecode_probe", precompile=("bytecode_probe",)) == cache
    assert [path.stat().st_mtime_ns for path in compiled] == written
    assert importlib.import_module("bytecode_probe.part").PART == 2


def test_a_failed_head_start_leaves_the_start_to_compile_on_import(
        package: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Compiling ahead is an optimisation: where its worker processes cannot start, the service starts
    all the same and its imports write the bytecode."""
    import realtime.bytecode as bytecode

    def no_processes(*args: object, **kwargs: object) -> None:
        raise OSError("no process may be started here")

    monkeypatch.setattr(bytecode, "ProcessPoolExecutor", no_processes)
    cache = tmp_path / "cache"
    with caplog.at_level(logging.WARNING, logger="realtime.bytecode"):
        assert keep_bytecode(cache, "bytecode_probe", precompile=("bytecode_probe",)) == cache
    assert "bytecode not compiled ahead (OSError: no process may be started here)" in caplog.text
    assert importlib.import_module("bytecode_probe.part").PART == 2
    assert Path(importlib.util.cache_from_source(str(package.parent / "part.py"))).is_file()


def child_commands() -> list[str]:
    """The command lines of this process's children (Linux)."""
    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
    return [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() for pid in children
            if Path(f"/proc/{pid}/cmdline").exists()]
