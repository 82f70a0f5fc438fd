"""`python -m hpcdl.nn summary MODEL --input-shape C,H,W --num-classes K [--json]`
`python -m hpcdl.nn export CHECKPOINT --to torch|safetensors|onnx OUT [--input-shape C,H,W]`

Prints a Keras-style table of MODEL (a built-in name, or your own package.module:function or
path/to/file.py:function, as --model takes): layer, output shape of one sample, parameters;
then the totals of parameters and buffers (BatchNorm running statistics, not trained). With
--json the last line is one JSON object: model, input_shape, num_classes, parameters, buffers,
layers. See docs/models.md.

export writes a checkpoint's model as a PyTorch state dict (torchvision's names for
resnet18/50), a safetensors file or an ONNX graph (hpcdl.export; docs/models.md).
"""

from __future__ import annotations

import argparse
import json
import sys

from hpcdl.export import FORMATS, ExportRequest, export
from hpcdl.helpformat import HelpFormatter
from hpcdl.nn.models import MODELS, build_model
from hpcdl.nn.summary import layer_rows, summary_record, summary_table

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
    e = sub.add_parser(
        "export",
        help="write a checkpoint's model as a PyTorch state dict, safetensors or ONNX",
        description=__doc__,
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    e.add_argument("checkpoint", metavar="CHECKPOINT", help="an hpcdl checkpoint (.h5)")
    e.add_argument("--to", required=True, choices=FORMATS, help="output format")
    e.add_argument("out", metavar="OUT", help="the file to write (never replaced if it exists)")
    e.add_argument(
        "--input-shape",
        help="C,H,W the model was trained on (default: from the checkpoint's --data and "
        "--augment, when that data is readable here)",
    )
    e.add_argument(
        "--model",
        help="the model spec to rebuild (default: the checkpoint's; give it when a user's "
        "file.py:function moved)",
    )
    return p


def parse_shape(text: str) -> tuple[int, int, int]:
    """'C,H,W' -> (C, H, W); ValueError naming the flag unless three positive integers."""
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"--input-shape must be C,H,W (three positive integers), got {text!r}")
    return shape  # type: ignore[return-value]


def summarize(args: argparse.Namespace) -> dict:
    """The summary record of args.model; ValueError (one line) for any wrong input."""
    if args.num_classes < 2:
        raise ValueError(f"--num-classes must be >= 2, got {args.num_classes}")
    shape = parse_shape(args.input_shape)
    model = build_model(args.model, shape, args.num_classes)
    try:
        rows = layer_rows(model)
    except ValueError as exc:
        raise ValueError(f"model {args.model!r}: for input {shape}, {exc}") from None
    return summary_record(model, rows)


def run_export(args: argparse.Namespace) -> str:
    """Write the export; the line that says what was written."""
    shape = parse_shape(args.input_shape) if args.input_shape else None
    model = export(ExportRequest(args.checkpoint, args.to, args.out, shape, args.model))
    return (
        f"{PROG} export: wrote {args.out} ({args.to}, model {model.name}, input "
        f"{model.input_shape}, {model.num_classes} classes)"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "export":
            print(run_export(args))
            return 0
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
