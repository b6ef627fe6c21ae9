"""Bench suite ``reference``: tokens/s of the single-process reference trainer on a run (default: demo).

Warms up a few steps (allocator, kernels), then times N optimizer steps end to end.
"""

from __future__ import annotations

import argparse
import os
import time


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="bench.py reference")
    parser.add_argument("--config", default=None, help="run config TOML (default: the demo run)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    args = parser.parse_args(argv)

    import torch

    from protolearn.stages.config import load_run_config
    from protolearn.stages.reference import ReferenceTrainer

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    run_cfg = load_run_config(args.config)
    trainer = ReferenceTrainer(run_cfg)
    for _ in range(args.warmup):
        trainer.train_step()
    t0 = time.perf_counter()
    losses = [trainer.train_step()["loss"] for _ in range(args.steps)]
    seconds = time.perf_counter() - t0
    tokens = run_cfg.batch.tokens_per_step * args.steps
    return {
        "run": run_cfg.name,
        "params": trainer.num_params(),
        "num_stages": trainer.plan.num_stages,
        "tokens_per_step": run_cfg.batch.tokens_per_step,
        "steps": args.steps,
        "seconds": seconds,
        "s_per_step": seconds / args.steps,
        "tokens_per_s": tokens / seconds,
        "last_loss": losses[-1],
        "threads": torch.get_num_threads(),
    }
