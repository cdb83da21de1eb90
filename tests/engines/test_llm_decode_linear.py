"""The fused decode projections (Triton, CUDA only) against the general path's definitions: RMSNorm then
the matmul and bias, SwiGLU of gate|up, the residual sum; at the full model's sizes with norm weights,
biases and weights where nothing is zero, in bf16 and fp16; and a tiny model's decode logits through
them, inside and outside the row counts they serve."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from engines.config import ModelConfigs
from engines.llm.model import CosyVoice2LM
from engines.llm.qwen2 import EAGER_KERNELS, CacheBatch, KVCache

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")
HIDDEN, QKV, INTERMEDIATE, EPS = 896, 1152, 4864, 1e-6


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def normed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm as the model runs it: fp32 statistics, the weight applied, then rounded to x's dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), EPS).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_projections_equal_their_definitions(rows: int, dtype: torch.dtype) -> None:
    from engines.llm.decode_linear import DecodeLinears

    generator = torch.Generator(device=CUDA).manual_seed(rows)

    def randn(*shape: int, scale: float = 1.0, offset: float = 0.0) -> torch.Tensor:
        return (torch.randn(shape, generator=generator, device=CUDA) * scale + offset).to(dtype)

    linears = DecodeLinears(HIDDEN, INTERMEDIATE, CUDA)
    residual = randn(rows, HIDDEN, scale=3.0, offset=0.5)
    norm_weight = randn(HIDDEN, scale=0.3, offset=1.0)

    qkv_weight, qkv_bias = randn(QKV, HIDDEN, scale=0.05), randn(QKV, scale=0.5)
    expected = (normed(residual, norm_weight).float() @ qkv_weight.float().t() + qkv_bias.float()).to(dtype)
    qkv = linears.norm_linear(residual, norm_weight, EPS, qkv_weight, qkv_bias)
    assert qkv.shape == (rows, QKV)
    assert relative_error(qkv, expected) < 1e-2

    gate_up_weight = randn(2 * INTERMEDIATE, HIDDEN, scale=0.05)
    gate, up = (normed(residual, norm_weight).float() @ gate_up_weight.float().t()).to(dtype).chunk(2, dim=-1)
    expected = (F.silu(gate.float()) * up.float()).to(dtype)
    hidden = linears.norm_linear(residual, norm_weight, EPS, gate_up_weight, None, gated=True)
    assert hidden.shape == (rows, INTERMEDIATE)
    assert relative_error(hidden, expected) < 1e-2

    for x, weight in ((randn(rows, HIDDEN), randn(HIDDEN, HIDDEN, scale=0.05)),  # o_proj: 7 splits past a row
                      (hidden, randn(HIDDEN, INTERMEDIATE, scale=0.05))):  # down
        product = x.float() @ weight.float().t()
        expected = (residual.float() + product).to(dtype)
        summed = residual.clone()
        assert linears.add_linear_(summed, x, weight) is summed
        # Measured against the product's size, not the sum's (the residual would hide a wrong product).
        assert ((summed.float() - expected.float()).norm() / product.norm()).item() < 1e-2
        # The split counters are zero again, and the same call gives the same bits (the partials are
        # added in split order, whichever split finishes last).
        assert not linears.counters.any()
        again = residual.clone()
        linears.add_linear_(again, x, weight)
        assert torch.equal(again, summed)


def test_split_sums_replay_in_a_cuda_graph() -> None:
    """o_proj's and down's split-K adds captured in one graph (as a decode step is): each replay equals
    the same calls run eagerly, bit for bit, and leaves every split counter at zero for the next."""
    from engines.llm.decode_linear import DecodeLinears

    torch.manual_seed(3)
    linears = DecodeLinears(HIDDEN, INTERMEDIATE, CUDA)
    rows = 5
    attended = torch.randn(rows, HIDDEN, device=CUDA).to(torch.bfloat16)
    hidden = torch.randn(rows, INTERMEDIATE, device=CUDA).to(torch.bfloat16)
    o_weight = (torch.randn(HIDDEN, HIDDEN, device=CUDA) * 0.05).to(torch.bfloat16)
    down_weight = (torch.randn(HIDDEN, INTERMEDIATE, device=CUDA) * 0.05).to(torch.bfloat16)
    start = torch.randn(rows, HIDDEN, device=CUDA).to(torch.bfloat16)

    def step(residual: torch.Tensor) -> None:
        linears.add_linear_(residual, attended, o_weight)
        linears.add_linear_(residual, hidden, down_weight)

    captured, eager = start.clone(), start.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(captured.clone())  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(captured)
    captured.copy_(start)
    for _ in range(3):
        graph.replay()
        step(eager)
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
        assert not linears.counters.any()
    assert not torch.equal(captured, start)


@pytest.mark.parametrize("rows", [1, 5])
def test_programmatic_launches_in_a_graph_equal_plain_ones(rows: int) -> None:
    """Three layers' chain of decode kernels (q|k|v, attention with its cache write, o_proj, gate|up,
    down) captured in one CUDA graph, launched with programmatic dependent launch and plainly: every
    replay leaves the same residual and cache, bit for bit, and the split counters at zero."""
    from engines.llm import programmatic_launch
    from engines.llm.decode_attention import DecodeAttention
    from engines.llm.decode_linear import DecodeLinears
    from engines.llm.qwen2 import rope_tables

    if not programmatic_launch.supported(CUDA):
        pytest.skip("this GPU or Triton has no programmatic dependent launch")
    generator = torch.Generator(device=CUDA).manual_seed(rows)

    def randn(*shape: int, scale: float = 1.0, offset: float = 0.0) -> torch.Tensor:
        return (torch.randn(shape, generator=generator, device=CUDA) * scale + offset).to(torch.bfloat16)

    layers, heads, kv_heads, head_dim, kv_len = 3, 14, 2, 64, 256
    weights = [(randn(HIDDEN, scale=0.3, offset=1.0), randn(QKV, HIDDEN, scale=0.05), randn(QKV, scale=0.5),
                randn(HIDDEN, HIDDEN, scale=0.05), randn(HIDDEN, scale=0.3, offset=1.0),
                randn(2 * INTERMEDIATE, HIDDEN, scale=0.05), randn(HIDDEN, INTERMEDIATE, scale=0.05))
               for _ in range(layers)]
    positions = torch.randint(1, kv_len, (rows,), generator=generator, device=CUDA)
    cos, sin = rope_tables(positions[:, None], head_dim, 1e6, torch.bfloat16)
    start_residual = randn(rows, HIDDEN, scale=3.0, offset=0.5)
    start_cache = randn(layers, rows, 2 * kv_heads, kv_len, head_dim)
    def replays(programmatic: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        linears = DecodeLinears(HIDDEN, INTERMEDIATE, CUDA, programmatic)
        attention = DecodeAttention(rows, kv_heads, CUDA, programmatic)
        residual, cache = start_residual.clone(), start_cache.clone()

        def step() -> None:
            for layer, (norm1, qkv_w, qkv_b, o_w, norm2, gate_up_w, down_w) in enumerate(weights):
                qkv = linears.norm_linear(residual, norm1, EPS, qkv_w, qkv_b)
                attended = attention(qkv.view(rows, heads + 2 * kv_heads, head_dim),
                                     (cos[:, 0, 0], sin[:, 0, 0]), cache[layer], 0, positions, kv_len)
                linears.add_linear_(residual, attended.view(rows, HIDDEN), o_w)
                hidden = linears.norm_linear(residual, norm2, EPS, gate_up_w, None, gated=True)
                linears.add_linear_(residual, hidden, down_w)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # compiles the kernels outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        residual.copy_(start_residual)
        cache.copy_(start_cache)
        states = []
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            states.append((residual.clone(), cache.clone()))
            assert not linears.counters.any() and not attention.counters.any()
        return states

    results = [replays(programmatic) for programmatic in (False, True)]
    for (plain_residual, plain_cache), (pdl_residual, pdl_cache) in zip(*results, strict=True):
        assert plain_residual.isfinite().all()
        assert torch.equal(pdl_residual, plain_residual) and torch.equal(pdl_cache, plain_cache)


def test_inputs_it_cannot_serve_are_refused() -> None:
    from engines.llm.decode_linear import DecodeLinears

    linears = DecodeLinears(HIDDEN, INTERMEDIATE, CUDA)
    x = torch.zeros(17, HIDDEN, device=CUDA, dtype=torch.bfloat16)
    weight = torch.zeros(HIDDEN, HIDDEN, device=CUDA, dtype=torch.bfloat16)
    assert linears.serves(16) and not linears.serves(17)
    with pytest.raises(ValueError, match="at most 16"):
        linears.add_linear_(x.clone(), x, weight)
    with pytest.raises(ValueError, match="contiguous weight"):
        linears.norm_linear(x[:4], x[0], EPS, weight.t(), None)
    with pytest.raises(ValueError, match="share a dtype"):
        linears.add_linear_(x[:4].clone(), x[:4].half(), weight)
    wider = torch.zeros(2 * HIDDEN, HIDDEN, device=CUDA, dtype=torch.bfloat16)  # more columns than sized for
    with pytest.raises(ValueError, match="sized for 896 output columns"):
        linears.add_linear_(torch.zeros(4, 2 * HIDDEN, device=CUDA, dtype=torch.bfloat16), x[:4], wider)


@pytest.mark.parametrize("rows", [1, 3, 20])  # 20: past what the kernels serve, the general path runs
def test_tiny_model_decode_logits_equal_the_general_path(rows: int) -> None:
    from engines.llm.decode_attention import DecodeAttention
    from engines.llm.decode_linear import DecodeLinears

    torch.manual_seed(0)
    cfg = ModelConfigs.tiny().llm
    qwen = cfg.qwen
    general = CosyVoice2LM(cfg).eval().requires_grad_(False)
    with torch.no_grad():  # norms, biases and weights all drawn: none zero, none one
        for param in general.backbone.layers.parameters():
            param.normal_(0.0, 0.15)
        for layer in general.backbone.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.uniform_(0.5, 1.5)
    general = general.to(CUDA, torch.bfloat16)
    fused = CosyVoice2LM(cfg).to(CUDA, torch.bfloat16).eval().requires_grad_(False)
    fused.load_state_dict(general.state_dict())
    attention = DecodeAttention(rows, qwen.num_kv_heads, CUDA)
    general.backbone.ops = dataclasses.replace(EAGER_KERNELS, decode_attention=attention)
    fused.backbone.ops = dataclasses.replace(
        EAGER_KERNELS, decode_attention=attention,
        decode_linears=DecodeLinears(qwen.hidden_size, qwen.intermediate_size, CUDA))
    prompt = torch.randn(rows, 20, qwen.hidden_size, device=CUDA, dtype=torch.bfloat16)
    logits = []
    with torch.no_grad():
        for model in (general, fused):
            cache = KVCache.allocate(qwen, rows, 64, CUDA, torch.bfloat16)
            model(prompt, CacheBatch(0, torch.arange(20, device=CUDA).expand(rows, -1), 32), cache)
            positions = [torch.full((rows, 1), 20 + i, device=CUDA) for i in range(6)]
            steps = [model(prompt[:, i : i + 1], CacheBatch(0, at, 32), cache)
                     for i, at in enumerate(positions)]
            logits.append(torch.stack(steps))
    assert logits[1].isfinite().all()
    error = relative_error(logits[1], logits[0])
    if rows > 16:
        assert error == 0.0
    else:
        assert 0.0 < error < 2e-2  # different kernels: close, not the same bits
