"""Encode and decode throughput of every activation codec, measured side by side in one run.

:func:`codec_speeds` encodes and decodes the same float32 activation (1024 rows, ``mib`` MiB in all)
with each codec several times and reports the median MiB/s of raw (uncompressed) tensor bytes, plus
the wire size and reconstruction error. ``scripts/bench.py transport`` merges the result into its
JSON; run this file alone to print it: ``python scripts/bench_codecs.py [--mib N] [--reps N]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from protolearn.protocol.codecs import decode, make_encoder

CODEC_SPECS = ("none", "fp16", "bf16", "int8", "topk:0.05", "topk:0.01")
ROWS = 1024


def _median_seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def codec_speeds(mib: int = 16, *, reps: int = 7, seed: int = 0) -> dict[str, dict]:
    """Return ``{codec: {encode_mib_s, decode_mib_s, ratio, rel_error}}`` for a (1024, mib*256) float32 tensor."""
    cols = mib * 1024 * 1024 // (4 * ROWS)
    x = torch.randn(ROWS, cols, generator=torch.Generator().manual_seed(seed))  # (1024, 4096) at 16 MiB
    raw_mib = x.numel() * x.element_size() / 2**20
    results: dict[str, dict] = {}
    for spec in CODEC_SPECS:
        encoder = make_encoder(spec)
        frame, stats = encoder.encode(x)  # warm-up; for topk this also fills the residual as in steady state
        enc_s = _median_seconds(lambda: encoder.encode(x), reps)
        dec_s = _median_seconds(lambda: decode(frame, peer="bench", shape=list(x.shape)), reps)
        results[spec] = {
            "encode_mib_s": round(raw_mib / enc_s, 1),
            "decode_mib_s": round(raw_mib / dec_s, 1),
            "ratio": round(stats.ratio, 4),
            "rel_error": round(stats.rel_error, 6),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=16, help="size of the test activation in MiB")
    parser.add_argument("--reps", type=int, default=7, help="repetitions per measurement (median is reported)")
    args = parser.parse_args()
    print(json.dumps({"tensor_mib": args.mib, "torch_threads": torch.get_num_threads(), "codecs": codec_speeds(args.mib, reps=args.reps)}, indent=2))


if __name__ == "__main__":
    main()
