"""CosyVoice2 LM: llm.pt layout and strict loading, prompt layout, and the slot KV cache against
full re-forwards and against Hugging Face's Qwen2 (tiny random weights, CPU)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from reference import reference_manifest

from engines.checkpoints import CheckpointError, load_strict, read_manifest_tsv
from engines.config import LLMConfig, ModelConfigs
from engines.llm.hf_export import qwen2_hf_config
from engines.llm.model import CosyVoice2LM, load_llm, prompt_length
from engines.llm.qwen2 import EAGER_KERNELS, CacheBatch, KVCache, LayerKernels, Qwen2Model
from engines.precompiled import PrecompiledFunction, supported

MANIFEST = "cosyvoice2-0.5b.llm.pt.tsv"
TINY = ModelConfigs.tiny().llm
CPU = torch.device("cpu")


def tiny_model(seed: int = 0) -> CosyVoice2LM:
    torch.manual_seed(seed)
    model = CosyVoice2LM(TINY).eval().requires_grad_(False)
    with torch.no_grad():  # larger than the default init, so attention patterns are far from uniform
        for param in model.backbone.layers.parameters():
            param.normal_(0.0, 0.15)
    return model


def cache_for(model: CosyVoice2LM, slots: int = 4, max_len: int = 64) -> KVCache:
    return KVCache.allocate(model.cfg.qwen, slots, max_len, CPU, torch.float32)


def full_hidden(backbone: Qwen2Model, x: torch.Tensor, from_start: bool = False) -> torch.Tensor:
    """Hidden states [T, H] of a whole sequence `x` [T, H] in a fresh cache (`from_start`: attending
    among its own positions, as a prompt's first chunk does, rather than through the cache)."""
    length = x.shape[0]
    cache = KVCache.allocate(backbone.cfg, 1, length, CPU, torch.float32)
    batch = CacheBatch(0, torch.arange(length).unsqueeze(0), length, from_start)
    return backbone(x.unsqueeze(0), batch, cache)[0]


def test_state_dict_is_exactly_the_llm_pt_manifest_at_full_config() -> None:
    with torch.device("meta"):
        model = CosyVoice2LM(LLMConfig())
    expected = read_manifest_tsv(reference_manifest(MANIFEST))
    assert [(k, tuple(v.shape)) for k, v in model.state_dict().items()] == expected
    assert len(expected) == 295
    assert model.llm.model.lm_head.weight is model.backbone.embed_tokens.weight

    # A checkpoint with exactly the manifest's names and shapes loads strictly; one that differs names
    # the differences.
    state = {name: torch.empty(shape, device="meta") for name, shape in expected}
    load_strict(model, state, "manifest")
    state["llm_decoder.weight"] = torch.empty(6563, 896, device="meta")
    del state["llm.model.model.layers.3.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError) as caught:
        load_strict(model, state, "manifest")
    assert "llm_decoder.weight: expected [6564, 896], found [6563, 896]" in str(caught.value)
    assert "llm.model.model.layers.3.mlp.up_proj.weight" in str(caught.value)


def test_load_llm_round_trips_a_checkpoint_and_ties_the_text_head(tmp_path: Path) -> None:
    source = tiny_model(seed=3)
    path = tmp_path / "llm.pt"
    torch.save(source.state_dict(), path)
    loaded = load_llm(path, TINY, CPU, torch.float32)
    assert not loaded.training
    for name, value in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert loaded.llm.model.lm_head.weight is loaded.backbone.embed_tokens.weight

    half = load_llm(path, TINY, CPU, torch.bfloat16)
    assert half.llm_decoder.weight.dtype == torch.bfloat16


def test_load_llm_names_the_first_mismatches(tmp_path: Path) -> None:
    state = tiny_model().state_dict()
    state["speech_embedding.weight"] = torch.zeros(10, TINY.qwen.hidden_size)
    del state["llm_embedding.weight"]
    path = tmp_path / "llm.pt"
    torch.save(state, path)
    with pytest.raises(CheckpointError) as caught:
        load_llm(path, TINY, CPU, torch.float32)
    message = str(caught.value)
    assert "1 missing: llm_embedding.weight" in message
    assert f"speech_embedding.weight: expected [6564, {TINY.qwen.hidden_size}], found [10, 64]" in message


def test_prompt_embeddings_follow_the_zero_shot_layout() -> None:
    model = tiny_model()
    text = torch.tensor([5, 9, 7, 11])  # prompt text then target text
    speech = torch.tensor([100, 6560, 3])
    embeds = model.prompt_embeddings(text, speech)
    assert embeds.shape == (prompt_length(4, 3), TINY.qwen.hidden_size)
    expected = torch.cat((
        model.llm_embedding.weight[0:1],
        model.backbone.embed_tokens.weight[text],
        model.llm_embedding.weight[1:2],
        model.speech_embedding.weight[speech],
    ))
    assert torch.equal(embeds, expected)
    assert model.prompt_embeddings(text, torch.zeros(0, dtype=torch.int64)).shape[0] == prompt_length(4, 0)


@pytest.mark.parametrize("from_start", [False, True])
def test_backbone_matches_hugging_face_qwen2(from_start: bool) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = TINY.qwen
    # The fields the Hugging Face export writes: they alone must configure the same backbone.
    hf_config = transformers.Qwen2Config(**qwen2_hf_config(cfg), vocab_size=cfg.vocab_size)
    reference = transformers.Qwen2Model(hf_config).eval()
    ours = tiny_model().backbone
    reference.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(1, 48, cfg.hidden_size)
    with torch.no_grad():
        expected = reference(inputs_embeds=x).last_hidden_state[0]
    torch.testing.assert_close(full_hidden(ours, x[0], from_start), expected, atol=1e-5, rtol=1e-4)


def test_cached_decode_equals_a_full_forward() -> None:
    model = tiny_model()
    sequence = torch.randn(20, TINY.qwen.hidden_size)
    expected = model.speech_logits(full_hidden(model.backbone, sequence))
    cache = cache_for(model)
    slot, prompt = 2, 12
    # Prefill in two chunks, then one position at a time.
    model(sequence[None, :5], CacheBatch(slot, torch.arange(0, 5)[None], 5), cache)
    logits = model(sequence[None, 5:prompt], CacheBatch(slot, torch.arange(5, prompt)[None], prompt), cache)
    torch.testing.assert_close(logits[0], expected[prompt - 1], atol=1e-5, rtol=1e-4)
    for pos in range(prompt, 20):
        logits = model(sequence[None, pos:pos + 1], CacheBatch(slot, torch.tensor([[pos]]), 32), cache)
        torch.testing.assert_close(logits[0], expected[pos], atol=1e-5, rtol=1e-4)


def test_a_forward_of_its_first_layers_writes_their_cache_as_the_whole_forward() -> None:
    """A graph's warm-up runs one layer (`layers=1`): layer 0's keys and values are the whole forward's,
    and the other layers' cache is left as it was."""
    model = tiny_model()
    assert TINY.qwen.num_layers > 1
    sequence = torch.randn(1, 9, TINY.qwen.hidden_size)
    batch = CacheBatch(1, torch.arange(9)[None], 16)
    whole, first = cache_for(model), cache_for(model)
    model(sequence, batch, whole)
    model(sequence, batch, first, layers=1)
    assert torch.equal(first.kv[0], whole.kv[0])
    assert not first.kv[1:].any()


def test_batched_decode_equals_each_sequence_alone() -> None:
    model = tiny_model()
    lengths = [7, 15, 3]
    sequences = [torch.randn(n + 1, TINY.qwen.hidden_size) for n in lengths]
    batched, alone = cache_for(model), cache_for(model)
    for slot, (seq, n) in enumerate(zip(sequences, lengths, strict=True)):
        for cache in (batched, alone):
            model(seq[None, :n], CacheBatch(slot, torch.arange(n)[None], n), cache)
    # Slot 3 is idle: its row is computed at an arbitrary position and ignored.
    inputs = torch.stack([seq[n] for seq, n in zip(sequences, lengths, strict=True)] + [sequences[0][0]])
    positions = torch.tensor([[7], [15], [3], [40]])
    logits = model(inputs.unsqueeze(1), CacheBatch(0, positions, 32), batched)
    for slot, (seq, n) in enumerate(zip(sequences, lengths, strict=True)):
        single = model(seq[None, n:n + 1], CacheBatch(slot, torch.tensor([[n]]), 16), alone)
        torch.testing.assert_close(logits[slot], single[0], atol=1e-5, rtol=1e-4)
        full = model.speech_logits(full_hidden(model.backbone, seq))
        torch.testing.assert_close(logits[slot], full[n], atol=1e-5, rtol=1e-4)


def test_gathered_rows_equal_consecutive_rows_and_padding_is_harmless() -> None:
    model = tiny_model()
    sequence = torch.randn(30, TINY.qwen.hidden_size)
    expected = model.speech_logits(full_hidden(model.backbone, sequence))
    cache = cache_for(model)
    slot = torch.tensor([2])
    # Chunks of 9 and 11 real positions padded to 16: padding writes scratch past each chunk.
    for start, length in ((0, 9), (9, 11)):
        padded = torch.zeros(16, TINY.qwen.hidden_size)
        padded[:length] = sequence[start:start + length]
        positions = (start + torch.arange(16)).unsqueeze(0)
        hidden = model.backbone(padded.unsqueeze(0), CacheBatch(slot, positions, 32), cache)[0]
        torch.testing.assert_close(model.speech_logits(hidden[:length]), expected[start:start + length],
                                   atol=1e-5, rtol=1e-4)
    # Decode rows gathered by slot id, next to a consecutive-slot view of the same cache.
    for pos in range(20, 30):
        logits = model(sequence[None, pos:pos + 1], CacheBatch(slot, torch.tensor([[pos]]), 32), cache)
        torch.testing.assert_close(logits[0], expected[pos], atol=1e-5, rtol=1e-4)
    view_rows = CacheBatch(2, torch.tensor([[29]]), 32)
    logits = model(sequence[None, 29:30], view_rows, cache)
    torch.testing.assert_close(logits[0], expected[29], atol=1e-5, rtol=1e-4)


def test_compiled_elementwise_ops_equal_eager() -> None:
    """The fused (torch.compile) rope and SwiGLU give the eager model's logits, prefill and decode."""
    eager, fused = tiny_model(), tiny_model()
    fused.backbone.ops = LayerKernels.compiled()
    sequence = torch.randn(9, TINY.qwen.hidden_size)
    caches = cache_for(eager), cache_for(fused)
    prompt, step = sequence[None, :8].expand(2, -1, -1), sequence[None, 8:].expand(2, -1, -1)
    logits = []
    for model, cache in zip((eager, fused), caches, strict=True):
        model(prompt, CacheBatch(0, torch.arange(8)[None].expand(2, -1), 8), cache)
        logits.append(model(step, CacheBatch(0, torch.tensor([[8], [8]]), 16), cache))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(caches[1].kv, caches[0].kv, atol=1e-5, rtol=1e-4)


def _fused_logits(kernels: LayerKernels) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a prefill and a decode step through `kernels`, as the engine runs them (no_grad)."""
    model = tiny_model()
    model.backbone.ops = kernels
    sequence = torch.randn(9, TINY.qwen.hidden_size, generator=torch.Generator().manual_seed(5))
    cache = cache_for(model)
    with torch.no_grad():
        prompt_positions = torch.arange(8)[None].expand(2, -1)
        prefill = model(sequence[None, :8].expand(2, -1, -1), CacheBatch(0, prompt_positions, 8), cache)
        step = model(sequence[None, 8:].expand(2, -1, -1), CacheBatch(0, torch.tensor([[8], [8]]), 16), cache)
    return prefill, step


@pytest.mark.skipif(not supported(), reason="this torch has no ahead-of-time compile")
def test_kept_elementwise_kernels_equal_eager_and_a_later_process_compiles_none(tmp_path: Path) -> None:
    """The fused rope, SwiGLU and RMSNorm kept ahead of time (engines/precompiled.py, ordinary tensors
    under no_grad as the engine calls them) give the eager logits; a fresh interpreter loads every class
    and compiles nothing; sealed, the kernels compile no more."""
    import json
    import os
    import subprocess
    import sys

    kernels = LayerKernels.compiled(tmp_path)
    want = _fused_logits(EAGER_KERNELS)
    for got, wanted in zip(_fused_logits(kernels), want, strict=True):
        torch.testing.assert_close(got, wanted, atol=1e-5, rtol=1e-4)
    kept = [kernels.rope_, kernels.silu_mul, kernels.rms_norm]
    assert all(isinstance(kernel, PrecompiledFunction) and kernel.compiled >= 1 for kernel in kept)
    kernels.seal()
    script = textwrap.dedent(f"""
        import json, pathlib, torch
        import test_llm_model as t
        from engines.llm.qwen2 import LayerKernels
        torch.set_num_threads(1)  # as tests/conftest.py: the thread count is part of the guards' state
        kernels = LayerKernels.compiled(pathlib.Path({str(tmp_path)!r}))
        logits = t._fused_logits(kernels)
        kept = [kernels.rope_, kernels.silu_mul, kernels.rms_norm]
        print(json.dumps({{"compiled": sum(k.compiled for k in kept), "loaded": sum(k.variants for k in kept),
                          "logits": [x.tolist() for x in logits]}}))
    """)
    root = Path(__file__).resolve().parents[2]
    path = f"{root}{os.pathsep}{root / 'tests' / 'engines'}{os.pathsep}{root / 'tests'}"
    run = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True,
                         check=False, env={**os.environ, "PYTHONPATH": path})
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["compiled"] == 0 and report["loaded"] == sum(kernel.compiled for kernel in kept)
    for got, wanted in zip(report["logits"], want, strict=True):
        torch.testing.assert_close(torch.tensor(got), wanted, atol=1e-5, rtol=1e-4)
