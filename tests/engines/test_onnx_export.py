"""The exported DiT estimator graphs compute what the PyTorch DiT computes (onnxruntime on the CPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from engines.config import ModelConfigs
from engines.token2wav.dit import DiT
from engines.token2wav.onnx_export import (
    CHUNK_INPUTS,
    CHUNK_OUTPUTS,
    OFFLINE_INPUTS,
    EstimatorShapes,
    export_chunk_estimator,
    export_offline_estimator,
)

CFG = ModelConfigs.tiny().dit_flow.dit
SHAPES = EstimatorShapes(CFG)


@pytest.fixture(scope="module")
def dit() -> DiT:
    torch.manual_seed(0)
    return DiT(CFG).eval()


@pytest.fixture(scope="module")
def chunk_session(dit: DiT, tmp_path_factory: pytest.TempPathFactory) -> ort.InferenceSession:
    path = tmp_path_factory.mktemp("onnx") / "dit_chunk.onnx"
    export_chunk_estimator(dit, path)
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _random(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if name == "t":
            out[name] = torch.rand(shape, generator=generator)
        elif name == "mask":
            out[name] = torch.rand(shape, generator=generator) > 0.3
            out[name][:, :, 0] = True  # every row keeps a frame to attend to
        else:
            out[name] = torch.randn(shape, generator=generator)
    return out


def test_chunk_graph_declares_the_cache_layout(chunk_session: ort.InferenceSession) -> None:
    inputs = {i.name: i.shape for i in chunk_session.get_inputs()}
    assert tuple(inputs) == CHUNK_INPUTS
    assert inputs["att_cache"] == [CFG.depth, "batch", CFG.num_heads, "cache_frames", 2 * CFG.head_dim]
    assert inputs["cnn_cache"] == [CFG.depth, "batch", 2 * CFG.hidden_size, 2]
    assert tuple(o.name for o in chunk_session.get_outputs()) == CHUNK_OUTPUTS


@pytest.mark.parametrize(("batch", "frames", "cache"), [(2, 5, 0), (2, 1, 3), (4, 9, 7), (6, 4, 12)])
@torch.no_grad()
def test_chunk_graph_matches_the_dit(
    dit: DiT, chunk_session: ort.InferenceSession, batch: int, frames: int, cache: int
) -> None:
    inputs = _random(SHAPES.chunk_inputs(batch, frames, cache), seed=batch * 100 + cache)
    expected = dit.forward_chunk(*inputs.values())
    actual = chunk_session.run(None, {name: tensor.numpy() for name, tensor in inputs.items()})
    assert [a.shape for a in actual] == [
        SHAPES.frames(batch, frames), SHAPES.cnn_cache(batch), SHAPES.att_cache(batch, frames)
    ]
    for got, want in zip(actual, expected, strict=True):
        np.testing.assert_allclose(got, want.numpy(), atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_chunk_graph_continues_from_its_own_caches(dit: DiT, chunk_session: ort.InferenceSession) -> None:
    """Two chunks through the graph, the second after the first's caches, equal the DiT doing the same."""
    first = _random(SHAPES.chunk_inputs(2, 6, 0), seed=1)
    second = _random(SHAPES.chunk_inputs(2, 4, 0), seed=2)
    _, cnn, kv = chunk_session.run(None, {name: tensor.numpy() for name, tensor in first.items()})
    second_graph = {**{n: t.numpy() for n, t in second.items()}, "cnn_cache": cnn, "att_cache": kv}
    velocity = chunk_session.run(None, second_graph)[0]
    _, torch_cnn, torch_kv = dit.forward_chunk(*first.values())
    expected = dit.forward_chunk(*{**second, "cnn_cache": torch_cnn, "att_cache": torch_kv}.values())[0]
    np.testing.assert_allclose(velocity, expected.numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("batch", "frames"), [(2, 5), (4, 11)])
@torch.no_grad()
def test_offline_graph_matches_the_dit(dit: DiT, tmp_path: Path, batch: int, frames: int) -> None:
    path = tmp_path / "dit_offline.onnx"
    export_offline_estimator(dit, path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert tuple(i.name for i in session.get_inputs()) == OFFLINE_INPUTS
    inputs = _random(SHAPES.offline_inputs(batch, frames), seed=frames)
    expected = dit(*inputs.values())
    (actual,) = session.run(None, {name: tensor.numpy() for name, tensor in inputs.items()})
    np.testing.assert_allclose(actual, expected.numpy(), atol=1e-4, rtol=1e-4)
