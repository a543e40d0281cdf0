#!/usr/bin/env python
"""Train a memo reference model (GPT or Llama) on synthetic tokens or the bytes of a file.

Prints, per step: loss, step time, tokens/s per device (TGS), MFU (from the Memo paper's
``6·s·P + 6·n·h·s²`` FLOPs per sample; "n/a" when the device's peak is unknown, e.g. on
CPU without --peak-tflops) and peak device memory (NOTE [Measuring device memory] in
memo/train/meter.py). ``memo train`` does the same with memo's own strategies as well.

Examples:
    python examples/train_gpt.py --model tiny --seq-len 256 --steps 10
    python examples/train_gpt.py --model gpt-125m --device cuda --dtype bfloat16 \\
        --seq-len 8192 --strategy full-recompute --report run.json
    python examples/train_gpt.py --model tiny --data README.md --steps 50
"""

from __future__ import annotations

import argparse
import sys

from memo.errors import MemoError
from memo.train import (
    StrategyOptions,
    add_train_arguments,
    build_report,
    make_strategy,
    save_report,
    train,
    train_config_from_args,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Per-step metrics go to stdout, the progress bar to stderr.",
    )
    add_train_arguments(parser)
    parser.add_argument("--strategy", choices=("none", "full-recompute"), default="none",
                        help="'full-recompute' recomputes each layer in backward to save memory")
    parser.add_argument("--report", metavar="OUT.json", help="write a versioned JSON report of every step")
    parser.add_argument("--no-progress", action="store_true", help="hide the tqdm progress bar")
    args = parser.parse_args(argv)
    try:
        strategy = make_strategy(StrategyOptions(strategy=args.strategy))
        result = train(train_config_from_args(args), progress=not args.no_progress, strategy=strategy)
    except MemoError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.report:
        report = build_report(result)
        save_report(report, args.report)
        summary = report["summary"]
        first, last = summary["first_loss"], summary["last_loss"]
        print(f"report written to {args.report} (loss {first:.4f} -> {last:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
