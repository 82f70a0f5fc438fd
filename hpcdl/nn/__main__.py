"""`python -m hpcdl.nn summary MODEL --input-shape C,H,W --num-classes K [--json]`

Prints a Keras-style table of MODEL (a built-in name, or your own package.module:function or
path/to/file.py:function, as --model takes): layer, output shape of one sample, parameters;
then the totals of parameters and buffers (BatchNorm running statistics, not trained). With
--json the last line is one JSON object: model, input_shape, num_classes, parameters, buffers,
layers. See docs/models.md.

A checkpoint's model leaves hpcdl with `python -m hpcdl.export` (a command of its own, above
hpcdl.nn: it reads checkpoints and data sets, which hpcdl.nn may not).
"""

from __future__ import annotations

import argparse
import json
import sys

from hpcdl.helpformat import HelpFormatter
from hpcdl.nn.models import MODELS, build_model
from hpcdl.nn.summary import (
    ActivationMemoryError,
    layer_rows,
    parse_shape,
    summary_record,
    summary_table,
)

PROG = "python -m hpcdl.nn"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__, allow_abbrev=False, formatter_class=HelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "summary",
        help="layers, output shapes and parameter counts of a model",
        description=__doc__,
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    s.add_argument(
        "model",
        metavar="MODEL",
        help=f"{', '.join(MODELS)}, or your own: package.module:function or "
        "path/to/file.py:function",
    )
    s.add_argument(
        "--input-shape",
        required=True,
        help="C,H,W of one sample as the loader yields it (after --augment), e.g. 3,224,224",
    )
    s.add_argument("--num-classes", type=int, required=True, help="output classes, >= 2")
    s.add_argument("--json", action="store_true", help="last line: one JSON object")
    return p


def summarize(args: argparse.Namespace) -> dict:
    """The summary record of args.model; ValueError (one line) for any wrong input."""
    if args.num_classes < 2:
        raise ValueError(f"--num-classes must be >= 2, got {args.num_classes}")
    shape = parse_shape(args.input_shape)
    model = build_model(args.model, shape, args.num_classes)
    try:
        rows = layer_rows(model)
    except ActivationMemoryError as exc:
        raise ValueError(
            f"model {args.model!r}: for input {shape}, {exc}; give a smaller --input-shape"
        ) from None
    except ValueError as exc:
        raise ValueError(f"model {args.model!r}: for input {shape}, {exc}") from None
    return summary_record(model, rows)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        record = summarize(args)
    except ValueError as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    print(summary_table(record))
    if args.json:
        print(json.dumps(record))
    return 0


if __name__ == "__main__":
    from hpcdl import cli

    sys.exit(cli.run(main))
