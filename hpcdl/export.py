"""`python -m hpcdl.export CHECKPOINT --to torch|safetensors|onnx OUT [--input-shape C,H,W]`:
a trained model out.

The checkpoint (hpcdl.checkpoint) names its model and holds its parameters and BatchNorm
statistics; the model is rebuilt from that name (a user's builder: the --model spec the run was
given, from the checkpoint's configuration) for the input shape the run's loaders yielded, found
from the run's --data and --augment when that data is still readable, else given with
--input-shape. The class count is the classifier's output size in the checkpoint. The output:
- torch: a state dict (torch.save) that torchvision's resnet18/50, or the nn.Sequential of the
  same layers, loads with strict=True; num_batches_tracked holds the checkpoint's global step.
- safetensors: the same tensors (metadata format=pt), written without PyTorch.
- onnx: the inference graph of hpcdl.nn.onnx_export.
A torch engine's checkpoint (a run of a torch.nn.Module: its spec builds one) is exported by
hpcdl.torch_engine.export instead: the module's own state_dict (parameters and buffers), which
the user's module loads with load_state_dict (strict), or torch.onnx.export's graph.
OUT is never replaced (hpcdl.nn.weights_io.write_new_file).

It is a command, above hpcdl.checkpoint, hpcdl.nn, hpcdl.data and hpcdl.torch_engine: it reads
a checkpoint and the run's data set, which hpcdl.nn (no MPI, no data loading) may not. So the
command is its own, not a subcommand of `python -m hpcdl.nn`: that would make hpcdl.nn import
this module back.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from hpcdl import checkpoint
from hpcdl.helpformat import HelpFormatter
from hpcdl.nn.model import Model
from hpcdl.nn.models import build_model
from hpcdl.nn.onnx_export import to_onnx
from hpcdl.nn.summary import parse_shape
from hpcdl.nn.user_models import (
    call_builder,
    is_torch_module,
    is_torchvision,
    is_user_model,
    model_name,
)
from hpcdl.nn.weights_io import optional_import, state_dict, write_new_file, write_state

FORMATS = ("torch", "safetensors", "onnx")
PROG = "python -m hpcdl.export"


@dataclass(frozen=True)
class ExportRequest:
    """What `export` writes: the checkpoint, the format, the output file, and overrides."""

    checkpoint: str
    to: str
    out: str
    input_shape: tuple[int, int, int] | None = None
    model: str | None = None


@dataclass(frozen=True)
class Exported:
    """What was written: the model's name, the input shape it takes, its class count."""

    name: str
    input_shape: tuple[int, ...]
    num_classes: int


def export(request: ExportRequest) -> Exported:
    """Write request.out; returns what it holds. ValueError (one line) for bad input."""
    if request.to not in FORMATS:
        raise ValueError(f"--to must be one of {', '.join(FORMATS)}, got {request.to!r}")
    parent = Path(request.out).parent
    if parent.exists() and not parent.is_dir():
        raise ValueError(
            f"cannot write {request.out}: {parent} is not a directory; give a writable directory"
        )
    if not parent.is_dir():
        raise ValueError(f"{request.out}: directory {parent} does not exist")
    ckpt = _load(request.checkpoint)
    _check_spec_file(ckpt, request)
    exported = _export_torch_module(ckpt, request)
    if exported is not None:
        return exported
    model = model_of(ckpt, request)
    weights = state_dict(model, batches_tracked=ckpt.global_step)
    if request.to == "onnx":
        onnx = optional_import("onnx", "export", f"writing {request.out}")
        proto = to_onnx(model, weights)
        write_new_file(request.out, lambda tmp: onnx.save(proto, tmp))
    else:
        write_state(weights, request.out, request.to)
    return Exported(model.name, tuple(model.input_shape), model.num_classes)


def _load(path: str) -> checkpoint.Checkpoint:
    """The checkpoint at path; ValueError in export's words for a file that is none."""
    what = checkpoint.foreign(path)
    if what:
        raise ValueError(
            f"{path} is not an hpcdl checkpoint ({what}); give a ckpt-eNNNNN-sNNNNNNNNN.h5 "
            "file of a run's --checkpoint-dir"
        )
    try:
        return checkpoint.load(path)
    except checkpoint.CheckpointError as exc:  # its advice is for --resume: export's instead
        text = str(exc).removesuffix(checkpoint.DAMAGED)
        if text != str(exc):
            text += "the file is damaged or was not written by hpcdl; export another checkpoint"
        raise ValueError(text) from None


def _check_spec_file(ckpt: checkpoint.Checkpoint, request: ExportRequest) -> None:
    """Without --model, a user's builder file the checkpoint names must be there."""
    spec = ckpt.config.get("model") or ckpt.model
    where, _, function = spec.rpartition(":")
    if request.model or not is_user_model(spec) or not where.endswith(".py"):
        return
    if not Path(where).is_file():
        raise ValueError(
            f"checkpoint {request.checkpoint} was trained with --model {spec}, and {where} is "
            f"not a file here; if it moved or was renamed, give --model FILE.py:{function} "
            "(docs/models.md)"
        )


def moved(ckpt: checkpoint.Checkpoint, spec: str) -> bool:
    """spec is a user's builder in place of the checkpoint's user builder of another name (its
    file moved or was renamed): it is held to the checkpoint's parameters, not its name."""
    return is_user_model(spec) and is_user_model(ckpt.model) and model_name(spec) != ckpt.model


def _export_torch_module(ckpt: checkpoint.Checkpoint, request: ExportRequest) -> Exported | None:
    """A torch engine's checkpoint written by hpcdl.torch_engine.export; None for hpcdl's own
    models (torch is imported only when the spec is a torch model)."""
    spec = request.model or ckpt.config.get("model") or ckpt.model
    if not (is_torchvision(spec) or is_user_model(spec)):
        return None
    shape = request.input_shape or _input_shape(ckpt, request.checkpoint)
    built = None
    classes = int(ckpt.layout[0][1][0]) if ckpt.layout and ckpt.layout[0][1] else 0
    if not is_torchvision(spec):
        built = call_builder(spec, shape, classes)  # the last layer's output size: classes
        if not is_torch_module(built):
            return None
    try:
        from hpcdl.torch_engine import export as torch_export  # noqa: PLC0415 (imports torch)
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        raise ValueError(
            f"checkpoint {request.checkpoint}: --model {spec} needs torch, which is not "
            "installed: pip install 'hpcdl[torch]'"
        ) from None

    module = torch_export.rebuild(
        ckpt, request.checkpoint, spec, shape, classes, built, moved(ckpt, spec)
    )
    torch_export.write(module, request.to, request.out, shape)
    return Exported(spec, tuple(shape), classes)


def model_of(ckpt: checkpoint.Checkpoint, request: ExportRequest) -> Model:
    """The checkpoint's model, rebuilt and loaded with its parameters and statistics."""
    spec = request.model or ckpt.config.get("model") or ckpt.model
    # Another model than the checkpoint's (a torch module's checkpoint, --model mlp) is said as
    # such, before its arrays are read as this model's; a moved builder is held to its arrays.
    if not moved(ckpt, spec):
        checkpoint.check_model(
            ckpt, request.checkpoint, model_name(spec) if is_user_model(spec) else spec
        )
    shape = request.input_shape or _input_shape(ckpt, request.checkpoint)
    head, head_shape = ckpt.layout[0]  # offset 0: the last layer's first array
    if not head.endswith(".b") or len(head_shape) != 1:
        raise ValueError(
            f"checkpoint {request.checkpoint}: the model's last array is {head} {head_shape}, "
            "not a classifier's bias; export needs a model that ends in nn.Linear"
        )
    model = build_model(spec, shape, int(head_shape[0]))
    layout = [(name, tuple(s)) for name, s, _ in model.layout()]
    if moved(ckpt, spec):
        checkpoint.check_same_arrays(ckpt, request.checkpoint, spec, layout)
    name = ckpt.model if moved(ckpt, spec) else model.name
    checkpoint.check_compatible(
        ckpt, request.checkpoint, name, layout, buffer_values=int(model.buffers.size)
    )
    model.params[...] = ckpt.params
    model.buffers[...] = ckpt.buffers
    return model


def _input_shape(ckpt: checkpoint.Checkpoint, path: str) -> tuple[int, int, int]:
    """(C, H, W) the run's loaders yielded: its --data under its --augment."""
    from hpcdl.data import open_dataset  # noqa: PLC0415 (only when --input-shape is not given)
    from hpcdl.data.augment import parse_augment  # noqa: PLC0415
    from hpcdl.data.batch import output_shape  # noqa: PLC0415

    data = ckpt.config.get("data", "")
    try:
        ds = open_dataset(data)
        return tuple(output_shape(ds, parse_augment(ckpt.config.get("augment", "none"))))
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(
            f"checkpoint {path}: cannot tell the model's input shape from its --data "
            f"{data or '(none)'} ({exc}); give --input-shape C,H,W"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__, allow_abbrev=False, formatter_class=HelpFormatter
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="an hpcdl checkpoint (.h5)")
    p.add_argument("--to", required=True, choices=FORMATS, help="output format")
    p.add_argument("out", metavar="OUT", help="the file to write (never replaced if it exists)")
    p.add_argument(
        "--input-shape",
        help="C,H,W the model was trained on (default: from the checkpoint's --data and "
        "--augment, when that data is readable here)",
    )
    p.add_argument(
        "--model",
        help="the model spec to rebuild (default: the checkpoint's; give it when a user's "
        "file.py:function moved)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Write the export and say what was written; exit 2 with one line for bad input."""
    args = build_parser().parse_args(argv)
    try:
        shape = parse_shape(args.input_shape) if args.input_shape else None
        done = export(ExportRequest(args.checkpoint, args.to, args.out, shape, args.model))
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"{PROG}: wrote {args.out} ({args.to}, model {done.name}, input "
        f"{done.input_shape}, {done.num_classes} classes)"
    )
    return 0


if __name__ == "__main__":
    from hpcdl import cli

    sys.exit(cli.run(main))
