"""`hybridflow data gsm8k|math --input PATH --output FILE.parquet`: preprocess into verl-style Parquet.

Also `hybridflow data arithmetic --output FILE.parquet` writes the synthetic task as a file (handy
to inspect it, or to train from files like any other dataset).
"""

from __future__ import annotations

import argparse
import sys

from hybridflow.errors import DatasetError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", choices=["gsm8k", "math", "arithmetic"], help="which dataset to prepare")
    parser.add_argument(
        "--input",
        help="a .parquet/.jsonl/.json file, a glob, or a directory (e.g. an HF dataset snapshot: the --split files)",
    )
    parser.add_argument("--output", required=True, help="the Parquet file to write")
    parser.add_argument("--split", default="train", help="split name stored in extra_info (train/test)")
    parser.add_argument("--limit", type=int, default=0, help="keep only the first N rows (0 = all)")
    parser.add_argument("--seed", type=int, default=0, help="arithmetic: generation seed")


def run(args: argparse.Namespace) -> int:
    from hybridflow.data.files import write_parquet
    from hybridflow.data.preprocess import preprocess

    try:
        if args.kind == "arithmetic":
            from hybridflow.data.synthetic import arithmetic

            rows = arithmetic(split=args.split, seed=args.seed, num_samples=args.limit or 1000)
            path, n = write_parquet(rows, args.output), len(rows)
        else:
            if not args.input:
                print(f"hybridflow data {args.kind}: --input is required", file=sys.stderr)
                return 2
            path, n = preprocess(args.kind, args.input, args.output, args.split, args.limit)
    except DatasetError as e:
        print(f"hybridflow data {args.kind}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {n} rows to {path}")
    return 0
