"""The engines a `ServiceConfig` asks for, constructed but not started.

`load_engines` picks each backend through engines/*/auto.py, puts one LLM engine on every LLM device
and one token2wav backend on every token2wav device of the config's `DevicePlan`, and sets the CUDA
process options (TF32, Inductor's compile cache beside the models) first. The `Runtime` starts them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from engines.compilation import compile_cache_dir, host_cache_dir, keep_compiled_artifacts, use_tf32_matmuls
from engines.config import ModelPaths
from engines.llm.auto import select_llm
from engines.llm.base import LLMEngine
from engines.normalize import ReferenceNormalizer
from engines.text import TextFrontend
from engines.token2wav.auto import select_token2wav
from engines.token2wav.base import Token2Wav
from engines.voice_encoder import VoiceEncoder, VoiceLimits
from realtime.config import ServiceConfig
from realtime.placement import DevicePlan
from realtime.schedule import graphed_hops
from realtime.warm_up import preload_compile_workers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedEngines:
    """The engines of one models directory, constructed but not started: one LLM engine per device of
    `plan.llm_devices` and one token2wav backend per device of `plan.token2wav_devices`, in that order."""

    llms: tuple[LLMEngine, ...]
    token2wavs: tuple[Token2Wav, ...]
    text: TextFrontend
    voice_encoder: VoiceEncoder
    plan: DevicePlan

    def __post_init__(self) -> None:
        if (len(self.llms), len(self.token2wavs)) != (len(self.plan.llm_devices),
                                                      len(self.plan.token2wav_devices)):
            raise ValueError("one LLM engine per LLM device and one token2wav backend per token2wav device")


def _load_token2wav(config: ServiceConfig, device: str, compiled: Path | None,
                    preload_compile_workers: bool) -> Token2Wav:
    started = time.perf_counter()
    backend = select_token2wav(
        config.models_dir,
        config.token2wav_backend,
        config.flow,
        device,
        pool_size=max(4, config.token2wav_workers),
        # CUDA graphs replay from shared buffers: only one thread may run the backend with them.
        cuda_graphs=config.token2wav_workers == 1,
        dit_cache_rule=config.dit_cache_rule,
        solve_memory_bytes=config.token2wav_solve_bytes,
        vocoder_dtype=getattr(torch, config.vocoder_precision),
        final_chunk_graphs=config.final_chunk_graphs,
        precompiled=compiled,
        preload_compile_workers=preload_compile_workers,
        graph_hops=graphed_hops(config.first_chunk_tokens),
        extra_first_hops=config.first_chunk_rule.first_hops[1:],  # the light-load first chunk's, if any
    )
    logger.info("token2wav %s loaded on %s in %.1f s (HiFT decoder in %s)", backend.name, device,
                time.perf_counter() - started, config.vocoder_precision)
    return backend


def _load_text(paths: ModelPaths, max_text_chars: int) -> TextFrontend:
    return TextFrontend(paths.text_tokenizer, ReferenceNormalizer(), max_text_chars=max_text_chars,
                        tokenizer_cache=host_cache_dir(paths.root))


LLMsChosen = Callable[[tuple[LLMEngine, ...]], None]


def import_compiler() -> None:
    """Import Dynamo and Inductor, and the compiler's own modules, from this one thread before the LLM
    build and the token2wav load compile side by side. Their first imports are circular
    (`torch._inductor.utils` imports `torch._dynamo`, whose guards import `torch._inductor.utils`): the
    token2wav loader's `torch.compile` beside the LLM build's first Dynamo-wrapped call once failed a
    cold start with Python's import `_DeadlockError`. Both threads would import these anyway (under the
    GIL, one at a time): first here, the start is no longer."""
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401


def prepare_compilation(models_dir: Path, device: torch.device) -> Path | None:
    """Point the compilers' caches beside the models (engines/compilation.py), then import them
    (`import_compiler`); returns Inductor's folder in use. In this order because importing Dynamo sets
    TORCHINDUCTOR_CACHE_DIR to Inductor's default in /tmp where it is unset, which then read as a folder
    the environment names: every start compiled into /tmp, and a restart in a fresh container compiled
    everything again."""
    cache = keep_compiled_artifacts(compile_cache_dir(models_dir, device))
    import_compiler()
    return cache


def load_engines(config: ServiceConfig, on_llms: LLMsChosen | None = None) -> LoadedEngines:
    """The engines over `config.models_dir` on the devices of `config.device_plan`, backends picked by
    engines/*/auto.py (blocking: call it off the event loop). RuntimeError says why a backend asked for
    by name cannot run. `on_llms` is handed the LLM engines (constructed, not started) before token2wav
    loads, from this thread: a caller may start building them meanwhile."""
    plan = config.device_plan
    started = time.perf_counter()
    paths = ModelPaths(config.models_dir)
    # The text tokenizer and normaliser, the voice encoder's ONNX sessions and the token2wav weights
    # (file reads and host-to-device copies, after CUDA's initialisation) load side by side: most of it
    # runs outside the GIL.
    with ThreadPoolExecutor(max_workers=len(plan.token2wav_devices) + 2, thread_name_prefix="load") as pool:
        text_load = pool.submit(_load_text, paths, config.max_text_chars)
        encoder_load = pool.submit(
            VoiceEncoder,
            paths.speech_tokenizer,
            paths.campplus,
            device="cpu" if all(device == "cpu" for device in plan.llm_devices) else "auto",
            limits=VoiceLimits(max_seconds=config.max_voice_upload_s),
        )
        gpus = [torch.device(name) for name in (*plan.llm_devices, *plan.token2wav_devices)
                if torch.device(name).type == "cuda"]
        cache = None  # where compiled artifacts are kept (on GPUs; None: nowhere writable)
        if gpus:
            cache = prepare_compilation(config.models_dir, gpus[0])
            use_tf32_matmuls()
            logger.info("compiled kernels cached in %s", cache or "Inductor's default folder")
        slots = config.llm_slots or config.max_streams
        # Constructing an LLM engine is cheap: its weights load when it starts. First: which kind it is
        # decides whether token2wav's compile workers may take device memory before it builds.
        llms = tuple(
            select_llm(config.models_dir, config.llm_backend, device, max_slots=slots, precompiled=cache,
                       prefill_padding_limit=config.llm_prefill_padding,
                       programmatic_launch=config.llm_programmatic_launch)
            for device in plan.llm_devices
        )
        if on_llms is not None:
            on_llms(llms)
        token2wav_loads = [
            pool.submit(_load_token2wav, config, device, cache,
                        torch.device(device).type == "cuda" and preload_compile_workers(
                            llms, plan.llm_devices, plan.token2wav_devices, index,
                            torch.cuda.get_device_properties(device).total_memory))
            for index, device in enumerate(plan.token2wav_devices)
        ]
        token2wavs = tuple(load.result() for load in token2wav_loads)
        text, encoder = text_load.result(), encoder_load.result()
    for llm in llms:
        if llm.stats().max_slots != slots:
            logger.warning("the %s LLM engine batches up to %d requests, not %d", llm.name,
                           llm.stats().max_slots, slots)
    logger.info("engines loaded in %.1f s", time.perf_counter() - started)
    return LoadedEngines(llms, token2wavs, text, encoder, plan)
