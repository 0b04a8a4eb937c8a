"""`hybridflow export RUN_DIR_or_CKPT --output DIR [--step N] [--role actor|critic] [--merge]`."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source", help="a run directory (its latest checkpoint) or a checkpoints/step_N directory"
    )
    parser.add_argument("--output", "-o", required=True, help="directory to write the HF model to")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument(
        "--role", default="actor", choices=["actor", "critic"], help="which model to export (default: actor)"
    )
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer directory (default: the one saved with the checkpoint)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA checkpoint as plain HF weights with the adapters merged (default: a PEFT adapter directory)",
    )


def run(args: argparse.Namespace) -> int:
    from hybridflow.checkpoint.export import export_hf
    from hybridflow.checkpoint.manager import CheckpointError

    try:
        out = export_hf(
            args.source,
            args.output,
            args.tokenizer,
            step=args.step,
            role=args.role,
            overwrite=args.overwrite,
            merge=args.merge,
        )
    except CheckpointError as e:
        print(f"hybridflow export: {e}", file=sys.stderr)
        return 2
    except FileExistsError:  # export_hf's message names its Python argument; this command has a flag
        print(f"hybridflow export: {args.output} exists and is not empty; choose another --output "
              "or pass --overwrite", file=sys.stderr)  # fmt: skip
        return 2
    adapter = (out / "adapter_config.json").is_file()
    loads = "peft PeftModel.from_pretrained(base, dir)" if adapter else "transformers from_pretrained"
    print(f"exported {args.role} to {out} (loads with {loads})")
    return 0
