"""The bytes a step moves, per variant, counted op by op on the meta device (no GPU, no compute): the table of
docs/performance.md, "Bytes per step".

    python bench/benchmarks/bytes_per_step.py --out /tmp/bytes        # every case and variant, ~30 s on 2 cores
    python bench/benchmarks/bytes_per_step.py --cases "bert training 512 8" --variants eager ea-torch --top 15

Cases (``harness/bytes.py``, ``CASES``): BERT-Base in bf16, training and inference at N = 512 batch 8, training at
N = 2048 batch 2; the decoder benchmarks' ~125M Llama in bf16, prefill at N = 512 and 2048, and one decoding step on
the cache of a 2048-token prefill. Variants: eager, ``ea-torch`` (EA on torch operations, the default on CUDA),
``ea-triton`` (the Triton kernels and the fused attention tail, counted by their operators' declared bytes) and
``ea-torch-nhwc`` (torch operations, the convolutions channels-last on heads padded to a multiple of 8). The
compiled variants are not counted (inductor fuses and plans buffers the meta device does not show).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # harness/ is in bench/, one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import bytes as counted  # noqa: E402


def parse_case(text: str) -> counted.ByteCase:
    """``MODEL MODE N BATCH`` (``bert training 512 8``) -> a ByteCase."""
    try:
        model, mode, length, batch = text.split()
        case = counted.ByteCase(model, mode, int(length), int(batch))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'MODEL MODE N BATCH', got {text!r}") from None
    if model not in ("bert", "llama") or mode not in counted.MODES:
        raise argparse.ArgumentTypeError(f"model bert or llama, mode one of {counted.MODES}: got {text!r}")
    return case


def largest_ops(rows: list[dict], variant: str, top: int) -> str:
    """Per case, the ``top`` ops of ``variant`` that moved the most bytes, as Markdown lines."""
    lines = []
    for row in rows:
        ops = list(row["variants"][variant]["by_op"].items())[:top]
        lines.append(f"- {row['name']}: " + ", ".join(f"`{op}` {moved / 1e9:.2f} GB" for op, moved in ops))
    return "\n".join(lines)


def markdown_report(rows: list[dict], variants: tuple[str, ...], top: int) -> str:
    """The table and, for each EA variant, each case's largest ops."""
    parts = ["# Bytes per step (counted on the meta device)", "", counted.byte_table(rows, variants), ""]
    for variant in variants:
        parts += [f"Largest ops, {variant}:", "", largest_ops(rows, variant, top), ""]
    return "\n".join(parts)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's options (what sessions/gpu_session.sh's parsing test calls)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for bench_bytes.{json,md} (default: print only)")
    parser.add_argument("--cases", nargs="+", type=parse_case, default=list(counted.CASES))
    parser.add_argument("--variants", nargs="+", choices=counted.VARIANTS, default=list(counted.VARIANTS))
    parser.add_argument("--top", type=int, default=5, help="largest ops listed per case and variant")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    variants = tuple(args.variants)
    rows = counted.count_cases(tuple(args.cases), variants)
    report = markdown_report(rows, variants, args.top)
    print(report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {"cases": rows, "variants": variants, "environment": counted.environment_variables()}
        (args.out / "bench_bytes.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "bench_bytes.md").write_text(report)


if __name__ == "__main__":
    main()
