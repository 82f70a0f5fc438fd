"""Fine-tune torchvision's resnet18 from a `.pth` with hpcdl.train (docs/torch.md).

    python examples/finetune_resnet18.py resnet18.pth            # ImageNet weights, once
    mpirun -np 2 python -m hpcdl.train --model torchvision:resnet18 --init-from resnet18.pth \\
        --data flowers/train --val-data flowers/val --augment rrc224+flip --epochs 5 --lr 0.01

The first command saves torchvision's ImageNet weights as a state dict (torchvision downloads
them; on a machine without network, copy the file in). hpcdl.train loads every layer from it
but the classifier, which is re-initialised for the data set's classes (one line says so), and
trains with everything the launcher does: staging, checkpoints, `--resume auto`, metrics.

Without torchvision (the CPU-only torch wheel cannot import it), the same network is
hpcdl.bench.torch_models' resnet18, whose state-dict keys are torchvision's; `--random` saves
its fresh weights, and this file's builder trains it:

    python examples/finetune_resnet18.py resnet18.pth --random
    mpirun -np 2 python -m hpcdl.train --model examples/finetune_resnet18.py:resnet18 \\
        --init-from resnet18.pth --data flowers/train --epochs 5 --lr 0.01
"""

from __future__ import annotations

import argparse
import sys

import torch

from hpcdl.bench import torch_models


def resnet18(input_shape: tuple[int, int, int], num_classes: int) -> torch.nn.Module:
    """torchvision's resnet18, written out: hpcdl.train calls it on every rank."""
    return torch_models.resnet18(input_shape, num_classes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="the .pth to write (an existing file is not replaced)")
    ap.add_argument("--random", action="store_true", help="fresh weights, no torchvision")
    args = ap.parse_args(argv)
    if args.random:
        torch.manual_seed(0)
        model = resnet18((3, 224, 224), 1000)
    else:
        try:
            import torchvision  # noqa: PLC0415
        except ImportError:
            ap.error("torchvision is not installed: pip install torchvision, or give --random")
        try:
            model = torchvision.models.resnet18(weights="IMAGENET1K_V1")
        except OSError as e:  # no network on a compute node: URLError, a refused connection
            ap.error(
                f"could not download torchvision's ImageNet weights ({e}): on a machine "
                f"without network, copy {args.out} in from one with it, or give --random"
            )
    try:
        with open(args.out, "xb") as f:
            torch.save(model.state_dict(), f)
    except FileExistsError:
        ap.error(f"{args.out} exists; give a new file name")
    print(f"wrote {args.out}: resnet18's state dict, 1000 classes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
