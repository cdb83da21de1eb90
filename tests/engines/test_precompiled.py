"""engines/precompiled.py: a function compiled once per shape class, kept on disk, and loaded by a later
process without tracing; the DiT block through it equals the eager block (CPU, Inductor)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from weights import randomize

from engines.config import ModelConfigs
from engines.precompiled import SUFFIX, PrecompiledFunction, supported, variant_folder
from engines.token2wav.dit import BLOCK_INDUCTOR_SETTINGS
from engines.token2wav.flow_dit import DiTFlow

pytestmark = pytest.mark.skipif(not supported(), reason="this torch has no ahead-of-time compile")
ROOT = Path(__file__).resolve().parents[2]


def scaled_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, None, eps) * 2 + 1


def inputs(*shape: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, float]:
    generator = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=generator, dtype=dtype)
    return x, torch.randn(shape[-1], generator=generator, dtype=dtype), 1e-5


def test_a_variant_serves_its_class_and_a_new_class_compiles_another(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    function = PrecompiledFunction(scaled_norm, tmp_path / "norm", scaled_norm)
    for shape in ((4, 8, 16), (7, 3, 16), (2, 5, 16)):  # one class: every dim above 1
        torch.testing.assert_close(function(*inputs(*shape)), scaled_norm(*inputs(*shape)))
    assert function.compiled == 1
    with caplog.at_level(logging.INFO, logger="engines.precompiled"):
        torch.testing.assert_close(function(*inputs(4, 1, 16)), scaled_norm(*inputs(4, 1, 16)))  # a dim of 1
    assert function.compiled == 2
    # The log says which guard of the variant there was refused the new class.
    said = [r.getMessage() for r in caplog.records if "a new shape class compiles" in r.getMessage()]
    assert len(said) == 1 and "1 variants' first failing guards: " in said[0]
    assert "L['x']" in said[0], said[0]  # a guard on the function's argument
    assert len(list((tmp_path / "norm").glob(f"*{SUFFIX}"))) == 2


def test_variants_compile_where_torch_leaves_its_ahead_of_time_api_off(tmp_path: Path) -> None:
    """torch 2.11 (the GPU image's) has `enable_aot_compile` off by default: without it `torch.compile`'s
    result has no `aot_compile`, and every class fell back to the per-process compile."""
    with torch._dynamo.config.patch(enable_aot_compile=False):
        function = PrecompiledFunction(scaled_norm, tmp_path / "norm", scaled_norm)
        torch.testing.assert_close(function(*inputs(4, 8, 16)), scaled_norm(*inputs(4, 8, 16)))
    assert function.compiled == 1


def test_a_later_process_loads_the_variants_and_compiles_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "norm"
    first = PrecompiledFunction(scaled_norm, folder, scaled_norm)
    first(*inputs(4, 8, 16))
    first(*inputs(4, 1, 16))
    script = textwrap.dedent(f"""
        import json, pathlib, torch
        import test_precompiled as t  # the name pytest imported it by, as the saved graph recorded
        from engines.precompiled import PrecompiledFunction
        def no_tracing(*args, **kwargs):
            raise AssertionError("a loaded variant should need no torch.compile")
        torch.compile = no_tracing
        torch.set_num_threads(1)  # as tests/conftest.py: the thread count is part of the guards' global state
        function = PrecompiledFunction(t.scaled_norm, pathlib.Path({str(folder)!r}), t.scaled_norm)
        errors = [(function(*t.inputs(*shape)) - t.scaled_norm(*t.inputs(*shape))).abs().max().item()
                  for shape in ((3, 9, 16), (5, 1, 16))]
        print(json.dumps({{"loaded": function.variants, "compiled": function.compiled, "errors": errors}}))
    """)
    path = f"{ROOT}{os.pathsep}{ROOT / 'tests' / 'engines'}"
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                         check=False, env={**os.environ, "PYTHONPATH": path})
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["loaded"] == 2 and report["compiled"] == 0
    assert max(report["errors"]) < 1e-5


def test_after_seal_a_new_class_runs_uncompiled_and_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    function = PrecompiledFunction(scaled_norm, tmp_path / "norm", scaled_norm)
    function(*inputs(4, 8, 16))
    function.seal()
    with caplog.at_level(logging.WARNING, logger="engines.precompiled"):
        for _ in range(2):  # float64 fails the variant's dtype guard
            torch.testing.assert_close(function(*inputs(4, 8, 16, dtype=torch.float64)),
                                       scaled_norm(*inputs(4, 8, 16, dtype=torch.float64)))
    assert function.compiled == 1
    assert sum("run uncompiled" in record.getMessage() for record in caplog.records) == 1


def test_sealing_loads_the_variants_other_processes_saved_first(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A cold start's compile workers save classes the warm-up's first stage may not meet; sealing loads
    them, so a class met only in a later warm-up step runs compiled, not uncompiled."""
    folder = tmp_path / "norm"
    function = PrecompiledFunction(scaled_norm, folder, scaled_norm)
    worker = PrecompiledFunction(scaled_norm, folder, scaled_norm)  # as a compile worker's, in one process
    worker(*inputs(4, 8, 16))
    assert function.variants == 0
    function.seal()
    assert function.variants == 1
    with caplog.at_level(logging.WARNING, logger="engines.precompiled"):
        torch.testing.assert_close(function(*inputs(4, 8, 16)), scaled_norm(*inputs(4, 8, 16)))
    assert function.compiled == 0
    assert not [r for r in caplog.records if "run uncompiled" in r.getMessage()]


def test_a_file_that_does_not_load_is_skipped_and_its_class_compiled_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "norm"
    folder.mkdir()
    (folder / f"torn{SUFFIX}").write_bytes(b"not a compiled function")
    with caplog.at_level(logging.WARNING, logger="engines.precompiled"):
        function = PrecompiledFunction(scaled_norm, folder, scaled_norm)
    assert function.variants == 0 and "did not load" in caplog.text
    torch.testing.assert_close(function(*inputs(4, 8, 16)), scaled_norm(*inputs(4, 8, 16)))
    assert function.compiled == 1


def test_a_variant_file_a_killed_writer_left_aside_is_removed_when_the_folder_opens(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import os
    import time

    folder = tmp_path / "norm"
    folder.mkdir()
    aside = folder / f".kept{SUFFIX}.x1y2z3.tmp"
    aside.write_bytes(b"half a variant")
    day_ago = time.time() - 86400
    os.utime(aside, (day_ago, day_ago))
    with caplog.at_level(logging.INFO, logger="engines.precompiled"):
        PrecompiledFunction(scaled_norm, folder, scaled_norm)
    assert not aside.exists() and "1 unfinished variant files removed" in caplog.text


def test_a_failed_ahead_of_time_compile_hands_every_call_to_the_jit_function(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = []

    def jit(*args: object) -> torch.Tensor:
        calls.append(args)
        return scaled_norm(*args)  # type: ignore[arg-type]

    function = PrecompiledFunction(scaled_norm, tmp_path / "norm", jit)
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: None)  # no aot_compile on None
    with caplog.at_level(logging.WARNING, logger="engines.precompiled"):
        for shape in ((4, 8, 16), (4, 1, 16)):
            torch.testing.assert_close(function(*inputs(*shape)), scaled_norm(*inputs(*shape)))
    assert len(calls) == 2 and function.compiled == 0
    assert "ahead-of-time compile failed" in caplog.text
    assert not (tmp_path / "norm").exists()


class CountingPass(CustomGraphPass):
    """A post-grad pass that counts the graphs Inductor runs it on. Its uuid is new in every test, so
    no cached graph of an earlier run is loaded instead of compiled (a cache hit runs no pass)."""

    def __init__(self) -> None:
        self.graphs = 0
        self._uuid = uuid.uuid4().hex

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs += 1

    def uuid(self) -> str:
        return self._uuid


def test_variants_compile_under_the_inductor_settings_given(tmp_path: Path) -> None:
    """`inductor` settings hold while a variant compiles (the DiT block's pointwise autotuning is off that
    way), and only then."""
    counting = CountingPass()
    function = PrecompiledFunction(scaled_norm, tmp_path / "norm", scaled_norm,
                                   inductor={"post_grad_custom_post_pass": counting})
    torch.testing.assert_close(function(*inputs(4, 8, 16)), scaled_norm(*inputs(4, 8, 16)))
    assert function.compiled == 1 and counting.graphs == 1
    assert inductor_config.post_grad_custom_post_pass is None
    plain = PrecompiledFunction(scaled_norm, tmp_path / "plain", scaled_norm)
    plain(*inputs(4, 8, 16))
    assert plain.compiled == 1 and counting.graphs == 1


def test_the_folder_changes_with_the_source_and_every_key() -> None:
    root = Path("/cache")
    base = variant_folder(root, "norm", [json], ["config", "torch.float16"])
    assert base is not None and base.parent == root and base.name.startswith("norm-")
    assert variant_folder(root, "norm", [json], ["config", "torch.float16"]) == base
    assert variant_folder(root, "norm", [json, logging], ["config", "torch.float16"]) != base
    assert variant_folder(root, "norm", [json], ["config", "torch.float32"]) != base
    # Inductor's programmatic dependent launch changes every generated kernel's launch.
    with torch._inductor.config.patch({"triton.enable_pdl": True}):
        assert variant_folder(root, "norm", [json], ["config", "torch.float16"]) != base


def test_without_the_source_there_is_no_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_source(module: object) -> str:
        raise OSError("could not get source code")

    monkeypatch.setattr("inspect.getsource", no_source)
    assert variant_folder(Path("/cache"), "norm", [json], []) is None


def test_precompiled_dit_blocks_equal_eager_and_load_in_a_second_flow(tmp_path: Path) -> None:
    """The DiT block (a module, dataclass keys, the attention custom op) through Inductor, saved, then
    loaded by another flow of the same weights: its first chunk's mel equals the eager flow's, and the
    second flow compiles nothing."""
    from test_token2wav_batching import ATOL, RTOL, make_voice

    cfg = ModelConfigs.tiny().dit_flow
    tokens = torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(3))

    def first_chunk(flow: DiTFlow) -> torch.Tensor:
        speakers = [flow.prepare_speaker(make_voice(1, 12)) for _ in range(2)]
        streams = [flow.open_stream(speaker) for speaker in speakers]
        with torch.inference_mode():
            return flow.chunks(streams, [tokens, tokens], [False, False])[0]

    flows = []
    for _ in range(3):
        flow = DiTFlow(cfg).eval().requires_grad_(False)
        randomize(flow, seed=0)
        flows.append(flow)
    eager, compiling, loading = flows
    compiling.decoder.estimator.compile_blocks(precompiled=tmp_path)
    want = first_chunk(eager)
    torch.testing.assert_close(first_chunk(compiling), want, atol=ATOL, rtol=RTOL)
    loading.decoder.estimator.compile_blocks(precompiled=tmp_path)
    loading_block = loading.decoder.estimator._ragged_block
    assert isinstance(loading_block, PrecompiledFunction) and loading_block.variants >= 1
    assert loading_block.inductor == BLOCK_INDUCTOR_SETTINGS == {"triton.autotune_pointwise": False}
    torch.testing.assert_close(first_chunk(loading), want, atol=ATOL, rtol=RTOL)
    assert loading_block.compiled == 0


# One start of the service's token2wav on CUDA (TorchToken2Wav.from_models_dir keeps the compiled DiT
# block beside the models): warm up two batch sizes, then one chunk; report what it compiled and loaded.
CUDA_START = """
import json, sys, torch
from pathlib import Path
from test_token2wav_batching import make_voice
from engines.config import PRE_LOOKAHEAD
from engines.token2wav.base import ChunkJob
from engines.token2wav.torch_backend import TorchToken2Wav
backend = TorchToken2Wav.from_models_dir(sys.argv[1], "dit", "cuda", precompiled=Path(sys.argv[1]) / "kept")
backend.vocoder_seed = 0  # HiFT's noise: the same in both processes
speaker = backend.prepare_speaker(make_voice(1, 12))
backend.warmup(speaker, batches=(4, 2))
block = backend.flow.decoder.estimator._ragged_block
tokens = torch.randint(0, 100, (15 + PRE_LOOKAHEAD,), generator=torch.Generator().manual_seed(0))
audio = backend.run_chunks([ChunkJob(backend.open_stream(speaker), tokens, last=False) for _ in range(2)])
print(json.dumps({"compiled": block.compiled, "variants": block.variants,
                  "audio": [a.tolist() for a in audio]}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_restart_loads_the_compiled_block_and_compiles_nothing(tmp_path: Path) -> None:
    """Two processes over one models directory: the first compiles the DiT block's classes during its
    warm-up (in worker processes, then graphs captured through them), the second loads them all,
    compiles none, and its audio is the first's."""
    from engines.config import MANIFEST_NAME, ModelPaths
    from engines.token2wav.hift import HiFTGenerator

    cfg = ModelConfigs.tiny()
    paths = ModelPaths(tmp_path)
    paths.step_audio2_token2wav.mkdir(parents=True)
    flow = DiTFlow(cfg.dit_flow)
    randomize(flow, seed=0)
    torch.save(flow.state_dict(), paths.dit_flow)
    torch.save(HiFTGenerator(cfg.hift).state_dict(), paths.hift)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"size": "tiny"}))
    path = f"{ROOT}{os.pathsep}{ROOT / 'tests' / 'engines'}"
    reports = []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", CUDA_START, str(tmp_path)], cwd=ROOT, capture_output=True,
                             text=True, check=False, env={**os.environ, "PYTHONPATH": path})
        assert run.returncode == 0, run.stderr[-3000:]
        reports.append(json.loads(run.stdout.strip().splitlines()[-1]))
    first, second = reports
    # The first start's classes: compiled by the warm-up's worker processes (block_compile.py), or by
    # the warm-up itself for any they missed.
    assert first["variants"] > first["compiled"]  # the workers' variants, loaded by the warm-up
    assert second["compiled"] == 0 and second["variants"] == first["variants"]
    for a, b in zip(first["audio"], second["audio"], strict=True):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a))


def test_a_one_step_warm_up_compiles_every_class_the_whole_solve_runs(tmp_path: Path) -> None:
    """What a graph's warm-up run (`solve_ragged(steps=1)`) must do for the capture after it: meet every
    shape class of the DiT block that the whole solve meets, so the capture compiles nothing."""
    from test_token2wav_batching import PersistentSolver, batched_mels, make_voice, plans

    from engines.token2wav.batching import Buckets

    cfg = ModelConfigs.tiny().dit_flow
    recorder, compiled = (DiTFlow(cfg).eval().requires_grad_(False) for _ in range(2))
    for flow in (recorder, compiled):
        randomize(flow, seed=0)
    solver = PersistentSolver(recorder)  # records real inputs of each solve shape
    recorder.use_bucketed_solver(solver, Buckets(batch=(4,), frames=(20, 40, 80), prompt_frames=(64,),
                                                 own_frames=(16, 32, 64), history_tokens=(16, 48, 96)))
    speakers = [recorder.prepare_speaker(make_voice(1, 12)), recorder.prepare_speaker(make_voice(2, 7))]
    with torch.inference_mode():
        batched_mels(recorder, speakers, plans()[:2])
    compiled.decoder.estimator.compile_blocks(precompiled=tmp_path)
    block = compiled.decoder.estimator._ragged_block
    assert isinstance(block, PrecompiledFunction)
    first, later = solver.runs[0], solver.runs[-1]  # a first chunk (no own cache) and a later one
    assert first.own_frames == 0 < later.own_frames
    with torch.inference_mode():
        for shape in (first, later):
            compiled.decoder.solve_ragged(solver.inputs[shape], steps=1)
            warmed = block.compiled
            compiled.decoder.solve_ragged(solver.inputs[shape])
            assert block.compiled == warmed
    assert block.compiled >= 2


def test_a_size_oblivious_variant_serves_one_row_and_one_position_as_many(tmp_path: Path) -> None:
    """RMSNorm, SwiGLU and the sampler's uniforms (the LLM's row-wise kept functions) compiled with sizes
    of 1 not special: the variant compiled at a decode step of many rows serves one row, one position
    and a prefill alike, with the eager results; compiled the default way, the same calls need more
    than one class."""
    from engines.llm.qwen2 import rms_norm, silu_mul
    from engines.llm.sampling import draw_uniforms

    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(16, generator=generator) + 1
    shapes = ((32, 1, 16), (1, 1, 16), (4, 9, 16), (1, 5, 16))
    cases = [(rms_norm, lambda shape: (torch.randn(*shape, generator=generator), weight, 1e-6)),
             (silu_mul, lambda shape: (torch.randn(*shape[:-1], 2 * shape[-1], generator=generator),)),
             (draw_uniforms, lambda shape: tuple(torch.randint(0, 2**32, shape[:1], generator=generator)
                                                 for _ in range(2)))]
    for fn, make in cases:
        calls = [make(shape) for shape in shapes]
        oblivious = PrecompiledFunction(fn, tmp_path / f"{fn.__name__}-oblivious", fn, size_oblivious=True)
        default = PrecompiledFunction(fn, tmp_path / f"{fn.__name__}-default", fn)
        with torch.inference_mode():
            for args in calls:
                want = fn(*args)
                torch.testing.assert_close(oblivious(*args), want)
                torch.testing.assert_close(default(*args), want)
        assert (oblivious.compiled, oblivious.variants) == (1, 1), fn.__name__
        assert default.compiled > 1, fn.__name__
