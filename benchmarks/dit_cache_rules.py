"""Streaming DiT output against the offline output of the same utterances, per estimator-cache rule.

    python benchmarks/dit_cache_rules.py [--models DIR] [--utterances 3] [--tokens 1000]

Synthetic tiny weights (every tensor drawn; built into a temporary directory unless --models names one),
the default voice, random speech tokens, the service's exponential chunk schedule (15, 25, 50, 100,
200, 400, 400, … tokens). Offline = one solve with full attention over prompt and utterance (what
`Token2Wav.offline` computes). Rules (engines/token2wav/dit_cache.py): "untrimmed" keeps every frame
(its streaming equals the block-causal offline solve: the floor set by streaming's causality);
"reference" is Step-Audio2's driver (the default); "prompt_recent" the option. Prints the relative RMS
error of the streamed mel against offline over all frames and over the frames after the first 10 s,
the worst chunk, and the estimator frames a stream attends to at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

from engines.build.synthetic import DEFAULT_VOICE, build_random  # noqa: E402
from engines.config import PRE_LOOKAHEAD, ModelConfigs, ModelPaths  # noqa: E402
from engines.token2wav.flow_dit import DiTFlow, load_dit_flow  # noqa: E402
from engines.voice import VoicePrompt  # noqa: E402
from realtime.schedule import ExponentialHops, Progress  # noqa: E402

FRAMES_PER_SECOND = 50
RULES = ("untrimmed", "reference", "prompt_recent")


def hops_for(tokens: int) -> list[int]:
    policy, hops = ExponentialHops(), list[int]()
    while sum(hops) + policy.hop(len(hops), Progress()) + PRE_LOOKAHEAD <= tokens:
        hops.append(policy.hop(len(hops), Progress()))
    return hops


def stream(flow: DiTFlow, voice: VoicePrompt, tokens: torch.Tensor) -> tuple[list[torch.Tensor], int]:
    speaker = flow.prepare_speaker(voice)
    state = flow.open_stream(speaker)
    hops, mels, start = hops_for(tokens.numel()), [], 0
    for hop in hops:
        mels.append(flow.chunk(state, tokens[start : start + hop + PRE_LOOKAHEAD], last=False))
        start += hop
    mels.append(flow.chunk(state, tokens[start:], last=True))
    kept_prompt = state.keys.prompt
    prompt = speaker.prompt_frames if kept_prompt is None else len(kept_prompt)
    return mels, prompt + state.estimator_kv.shape[4]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, help="tiny synthetic models directory (default: build one)")
    parser.add_argument("--utterances", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1000, help="speech tokens per utterance (25 a second)")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as scratch:
        models = args.models or build_random(Path(scratch) / "tiny", "tiny")
        paths, cfg = ModelPaths(models), ModelConfigs.tiny().dit_flow
        voice = VoicePrompt.load(paths.voices / f"{DEFAULT_VOICE}.safetensors")
        configs = {"untrimmed": dataclasses.replace(cfg, att_cache_recent_frames=10**9),
                   "reference": dataclasses.replace(cfg, att_cache_rule="reference"),
                   "prompt_recent": dataclasses.replace(cfg, att_cache_rule="prompt_recent")}
        flows = {rule: load_dit_flow(paths.dit_flow, configs[rule], "cpu", torch.float32) for rule in RULES}
        generator = torch.Generator().manual_seed(0)
        results: dict[str, list[tuple[float, float, float, int]]] = {rule: [] for rule in RULES}
        for _ in range(args.utterances):
            tokens = torch.randint(0, cfg.vocab_size, (args.tokens,), generator=generator)
            offline = flows["reference"].offline(flows["reference"].prepare_speaker(voice), tokens)
            late = slice(10 * FRAMES_PER_SECOND, None)
            for rule in RULES:
                mels, attended = stream(flows[rule], voice, tokens)
                streamed = torch.cat(mels, dim=2)
                chunk_errors, start = [], 0
                for mel in mels[:-1]:
                    end = start + mel.shape[2]
                    chunk_errors.append(relative_error(mel, offline[..., start:end]))
                    start = end
                results[rule].append((relative_error(streamed, offline),
                                      relative_error(streamed[..., late], offline[..., late]),
                                      max(chunk_errors), attended))
    seconds = args.utterances * args.tokens / 25
    print(f"{args.utterances} utterances x {args.tokens} tokens ({seconds:.0f} s of audio), prompt "
          f"{voice.num_tokens} tokens, tiny synthetic DiT flow, fp32 CPU")
    print("| rule | rel. error, all frames | rel. error, after 10 s | worst chunk | frames attended, end |")
    print("|---|---|---|---|---|")
    for rule in RULES:
        rows = results[rule]
        mean = [sum(row[i] for row in rows) / len(rows) for i in range(3)]
        print(f"| {rule} | {mean[0]:.4f} | {mean[1]:.4f} | {max(row[2] for row in rows):.4f} | "
              f"{max(row[3] for row in rows)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
