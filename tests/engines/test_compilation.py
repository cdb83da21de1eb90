"""Where compiled kernels are kept: Inductor's and Triton's caches beside the models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from torch._inductor.runtime.cache_dir_utils import cache_dir, triton_cache_dir

from engines.compilation import CACHE_ENV, TRITON_CACHE_ENV, keep_compiled_artifacts


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Neither cache named by the environment; whatever the test sets is undone afterwards."""
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.delenv(TRITON_CACHE_ENV, raising=False)
    return monkeypatch


def test_both_caches_go_beside_the_models_before_any_compilation(clean_env: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    folder = tmp_path / "compile-cache" / "gpu"
    assert keep_compiled_artifacts(folder) == folder
    # torch's own lookups (Inductor's cache, and the Triton folder Inductor compiles into)...
    assert Path(cache_dir()) == folder
    assert Path(triton_cache_dir(0)) == folder / "triton"
    # ...and a Triton kernel compiled outside Inductor reads the variable itself.
    assert os.environ[TRITON_CACHE_ENV] == str(folder / "triton")


def test_folders_the_environment_names_are_kept(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv(CACHE_ENV, str(tmp_path / "inductor"))
    clean_env.setenv(TRITON_CACHE_ENV, str(tmp_path / "triton-elsewhere"))
    assert keep_compiled_artifacts(tmp_path / "unused") == tmp_path / "inductor"
    assert Path(cache_dir()) == tmp_path / "inductor"
    assert Path(triton_cache_dir(0)) == tmp_path / "triton-elsewhere"
    assert not (tmp_path / "unused").exists()


def test_inductor_folder_named_by_the_environment_still_gets_triton_beside_it(
        clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv(CACHE_ENV, str(tmp_path / "inductor"))
    keep_compiled_artifacts(tmp_path / "unused")
    assert Path(triton_cache_dir(0)) == tmp_path / "inductor" / "triton"


def test_unwritable_folder_leaves_the_defaults(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert keep_compiled_artifacts(blocker / "cache") is None
    assert CACHE_ENV not in os.environ and TRITON_CACHE_ENV not in os.environ
