"""HiFT's decoder in float16 / bfloat16 (`serve --vocoder-precision`, hift.HiFTGenerator.use_decoder_dtype)
against float32: how far the speech moves, and on CUDA how long a vocoder call takes from its graph.

Weights are random with nothing zero and conv_post scaled (`--conv-post-scale`) so that its outputs, which
become exp(log-magnitude) and sin(phase), are O(1) as a trained model's are; unscaled, random weights put
them near 80, where any rounding turns the phase into noise. The error is relative RMS (error RMS over
speech RMS) and its SNR in dB, over `--rows` rows of `--frames` mel frames with the same mel and noise.
What it means for released weights' audio must be heard with those weights.

    python3 benchmarks/vocoder_precision.py --size full --device cpu                       # error only
    bash benchmarks/on_device.sh python3 benchmarks/vocoder_precision.py --size full --device cuda \
        --rows 1 16 64 --frames 30 58 [--cudnn-benchmark]
    bash benchmarks/on_device.sh python3 benchmarks/vocoder_precision.py --size full --device cuda \
        --rows 16 64 --frames 408 --eager                                 # the steady chunks, eagerly

Prints a table; timings go to no test.
"""

from __future__ import annotations

import argparse
import copy
import math
from collections.abc import Callable

import torch

from engines.compilation import use_tf32_matmuls
from engines.config import HiFTConfig, ModelConfigs
from engines.token2wav.hift import HiFTGenerator, fold_weight_norm
from engines.token2wav.vocoder_graphs import GraphedVocoder

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def random_hift(cfg: HiFTConfig, conv_post_scale: float) -> HiFTGenerator:
    torch.manual_seed(0)
    hift = HiFTGenerator(cfg).eval()
    with torch.no_grad():
        for name, p in hift.named_parameters():
            if name.endswith("alpha"):
                p.copy_(torch.rand(p.shape) * 1.5 + 0.1)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape) / p[0].numel() ** 0.5)
            else:
                p.copy_(0.1 * torch.randn(p.shape))
    fold_weight_norm(hift)
    with torch.no_grad():
        hift.conv_post.weight.mul_(conv_post_scale)
    return hift


def device_ms(call: Callable[[], object], calls: int) -> float:
    """ms of device time per `call`, over `calls` calls after one untimed one (a first use captures or
    picks its plans)."""
    call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def graph_ms(hift: HiFTGenerator, mel: torch.Tensor, noise: torch.Tensor) -> float:
    """ms per vocoder call replayed from its CUDA graph (captured on first use)."""
    graphs = GraphedVocoder(hift, [(mel.shape[2], 0)], batches=(mel.shape[0],))
    return device_ms(lambda: graphs.vocode(mel, None, noise), 20)


def eager_ms(hift: HiFTGenerator, mel: torch.Tensor, noise: torch.Tensor) -> float:
    """ms per eager vocoder call (as the service runs shapes without a graph: the steady 200-token chunks,
    408 frames with the cache)."""
    return device_ms(lambda: hift.vocode_with_noise(mel, None, noise), 10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, nargs="+", default=[2])
    parser.add_argument("--frames", type=int, nargs="+", default=[40])
    parser.add_argument("--conv-post-scale", type=float, default=0.1)
    parser.add_argument("--cudnn-benchmark", action="store_true",
                        help="let cuDNN time its plans for every shape, eager calls too; without it, as in "
                             "the service, only a half decoder's graphs measure theirs (float32 takes the "
                             "heuristics' plans; docs/benchmarks.md, thirty-sixth session)")
    parser.add_argument("--eager", action="store_true",
                        help="time eager calls instead of graph replays (cuDNN's heuristics' plans, as the "
                             "service's calls without a graph run)")
    args = parser.parse_args()
    use_tf32_matmuls()  # the service's float32 (TF32 convolutions on CUDA)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    device = torch.device(args.device)
    cfg = ModelConfigs.tiny().hift if args.size == "tiny" else HiFTConfig()
    reference = random_hift(cfg, args.conv_post_scale)
    models = {}
    for dtype in DTYPES:
        model = copy.deepcopy(reference).to(device)
        model.use_decoder_dtype(dtype)
        models[dtype] = model
    timed = device.type == "cuda"
    print(f"HiFT {args.size}, {device if not timed else torch.cuda.get_device_name(device)}, "
          f"torch {torch.__version__}; conv_post × {args.conv_post_scale}"
          + ("; cuDNN benchmark" if args.cudnn_benchmark else "") + ("; eager calls" if args.eager else ""))
    print(f"{'rows':>4} {'frames':>6} {'decoder':>9} {'rel. error':>10} {'SNR dB':>7} {'max |error|':>11} "
          f"{'speech RMS':>10}" + (f" {'ms / call':>10}" if timed else ""))
    with torch.inference_mode():
        for rows in args.rows:
            for frames in args.frames:
                generator = torch.Generator().manual_seed(rows * 1000 + frames)
                mel = torch.randn(rows, cfg.in_channels, frames, generator=generator).to(device)
                noise = reference.draw_noise(generator, rows, frames * reference.hop_samples,
                                             torch.device("cpu")).to(device)
                want = models[torch.float32].vocode_with_noise(mel, None, noise).speech.float()
                rms = float(want.pow(2).mean().sqrt())
                for dtype, model in models.items():
                    # The graph first, as in the service: cuDNN caches the first plan it runs per
                    # convolution shape, and a half decoder's graph warm-up measures its plans.
                    ms = graph_ms(model, mel, noise) if timed and not args.eager else math.nan
                    got = model.vocode_with_noise(mel, None, noise).speech.float()
                    if timed and args.eager:
                        ms = eager_ms(model, mel, noise)
                    error = float((got - want).pow(2).mean().sqrt()) / rms
                    snr = -20 * math.log10(error) if error > 0 else math.inf
                    line = (f"{rows:>4} {frames:>6} {str(dtype).removeprefix('torch.'):>9} {error:>10.4f} "
                            f"{snr:>7.1f} {float((got - want).abs().max()):>11.4f} {rms:>10.4f}")
                    if timed:
                        line += f" {ms:>10.3f}"
                    print(line, flush=True)


if __name__ == "__main__":
    main()
