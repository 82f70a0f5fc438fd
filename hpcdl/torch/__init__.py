"""hpcdl's data path for PyTorch training scripts (docs/torch.md); `pip install hpcdl[torch]`.

    from hpcdl.torch import Loader
    loader = Loader(args.data, batch_size=64, epochs=args.epochs, stage_dir=args.stage_dir)
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        for images, labels in loader:   # torch tensors over shared-memory slots
            ...

PyTorch is imported only inside this package; the rest of hpcdl never imports it.
"""

from hpcdl.torch.dataloader import HpcdlSampler, HpcdlSamples
from hpcdl.torch.loader import Loader, LoaderStartError

__all__ = ["HpcdlSampler", "HpcdlSamples", "Loader", "LoaderStartError"]
