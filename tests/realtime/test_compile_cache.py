"""The service's compiled kernels land beside the models, as a fresh process sets them up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engines.compilation import CACHE_ENV, TRITON_CACHE_ENV

# A fresh interpreter: whether Dynamo is imported before or after the folders are chosen is the point.
# The service's modules are imported first, as `realtime serve` has them when it loads the engines.
SET_UP = """
import sys
from pathlib import Path

import torch

import realtime.app
import realtime.cli
from realtime.engine_loader import prepare_compilation

print(prepare_compilation(Path(sys.argv[1]), torch.device("cpu")))
from torch._inductor.runtime.cache_dir_utils import cache_dir, triton_cache_dir

print(cache_dir())
print(triton_cache_dir(0))
"""


def test_a_fresh_process_compiles_beside_the_models(tmp_path: Path) -> None:
    named = (CACHE_ENV, TRITON_CACHE_ENV)
    environment = {name: value for name, value in os.environ.items() if name not in named}
    finished = subprocess.run([sys.executable, "-c", SET_UP, str(tmp_path)], env=environment, check=True,
                              capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    chosen, inductor, triton = (Path(line) for line in finished.stdout.split())
    assert chosen.parent == tmp_path / "compile-cache" and chosen.is_dir()
    assert inductor == chosen  # Inductor's own lookup, after Dynamo's import
    assert triton == chosen / "triton"
