"""Training configuration: one dataclass, defaults in one place, TOML file + CLI flags.

Precedence: defaults < `--config job.toml` < command-line flags. TOML keys are the flag names
with underscores (`batch_size = 64`); relative paths in the file are relative to the file's
directory, relative paths in flags to the current directory. Every value is validated before
any MPI collective; an invalid one raises ConfigError with one sentence naming the field and the
allowed values.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcdl.config_paths import PATH_KEYS, empty_path_error, resolve_paths
from hpcdl.data.augment import parse_augment
from hpcdl.data.loader import LOADER_TIMEOUT_S
from hpcdl.nn.models import MODELS
from hpcdl.nn.user_models import is_torchvision, is_user_model, load_builder
from hpcdl.stage_flags import MAX_THREADS, stage_flags_error

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PROGRESS_MODES = ("auto", "bar", "epoch", "none")


PEER_MODES = ("auto", "on", "off")  # --peer-staging (hpcdl.staging.peer_tier)
STAGE_THREADS = 32  # the stager's copy threads by default (TrainConfig.stage_threads)
# The stager's niceness above the ranks' (TrainConfig.stage_nice): "auto" adds STAGE_NICE_LATER
# once the ranks pass the run's first epoch (docs/staging.md, "Below the ranks").
STAGE_NICE = "auto"
STAGE_NICE_LATER = 10
# --seed: numpy's SeedSequence takes any, but the augmentation hash holds a uint64 and the torch
# engine seeds seed + rank (torch.manual_seed: below 2**64), so seeds stay int64's.
MAX_SEED = 2**63 - 1


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field."""


@dataclass
class TrainConfig:
    data: str = ""
    val_data: str | None = None
    model: str = "cnn"
    epochs: int = 10
    batch_size: int = 32  # per rank
    lr: float = 0.01  # base learning rate, before scaling
    lr_scaling: str = "none"  # none | linear (lr * global_batch / base_batch)
    base_batch: int | None = None  # reference batch for linear scaling; default: per-rank batch
    warmup_epochs: float = 0.0
    lr_decay: str = "none"  # none | cosine | step
    optimizer: str = "sgd"
    momentum: float = 0.9  # PyTorch's and Keras's SGD default to 0
    nesterov: bool = False
    weight_decay: float = 0.0
    decay_bias_norm: bool = True  # False: no weight decay on biases and BatchNorm parameters
    sync_bn: bool = False  # BatchNorm statistics over all ranks (SyncBatchNorm)
    precision: str = "fp32"  # fp32 | bf16 | fp16 (hpcdl.nn.precision)
    gpu_kernels: bool = False  # opt-in fast kernels (hpcdl.nn.kernels), until a GPU run
    tf32: bool = False  # float32 convolutions and GEMMs on TF32 tensor cores (a GPU's)
    device: str = "cpu"
    seed: int = 0
    shuffle: str = "global"
    sync: str = "grad"  # grad | params:K
    bucket_mb: float = 25.0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # steps; 0 = at the end of every epoch only
    resume: str = "none"  # none | auto | PATH
    metrics: str | None = None
    metrics_every: int = 10
    quiet: bool = False  # no start-up lines and no progress (implies --progress none)
    progress: str = "auto"  # auto | bar | epoch | none (hpcdl.metrics.resolve_progress)
    workers: int | None = None  # None: a fair share of the node's cores
    prefetch: str = "auto"  # batch slots: auto (hpcdl.data.loader NOTE [default slots]) or N
    loader_timeout: float = LOADER_TIMEOUT_S  # seconds a worker may be silent on an awaited batch
    augment: str = "none"
    decode: str = "cpu"  # cpu: workers decode; gpu: workers read bytes, the rank decodes
    skip_bad_samples: bool = False
    index_in_data_root: bool = False  # cache an image folder's index in --data itself
    stage_dir: str | None = None
    # Copies in flight hide the PFS's open latency: 32 / 5 ms = 6,400 files/s (8 gave 1,600,
    # half of what the emulated PFS serves: docs/PERFORMANCE.md, issue 29). Mostly blocked in
    # open and read, so threads beyond the cores cost little CPU.
    stage_threads: int = STAGE_THREADS
    # The stager's niceness above the ranks' (docs/staging.md, "Below the ranks"): "auto", or
    # 0..19 from the start. At 10 from the start it sped up later epochs with peers on busy
    # cores, but staged epoch 1 later than the model says; auto keeps epoch 1 at 0.
    stage_nice: str = STAGE_NICE
    stage_capacity: str | None = None
    keep_staged: bool = False
    stage_verify: bool = False
    # Nodes serve staged files to each other (docs/staging.md, "Peer tier"); auto: with 2+
    # nodes and --shuffle global, where each node needs files that other nodes staged.
    peer_staging: str = "auto"
    # With tar shards, a node fetches the byte ranges of its samples from a shard's home
    # instead of the whole shard (hpcdl.staging.pieces); auto: where they are under half of it.
    peer_ranges: str = "auto"
    max_steps: int | None = None  # stop after this many global steps (benchmarks, tests)
    # Models in and out (issue 27): start from a state dict; TensorBoard event files.
    init_from: str | None = None  # .pth/.pt/.safetensors (hpcdl.nn.weights_io)
    tensorboard: str | None = None  # directory for tensorboardX event files, rank 0
    # Why is my job slow, or stuck (issue 36, hpcdl.diag).
    stall_warning: float = 60.0  # seconds a rank may wait in a collective or for its loader
    stall_shutdown: float | None = None  # seconds more, then the job ends with exit status 5
    timeline: str | None = None  # Chrome trace JSON of every rank's events
    on_node_loss: str = "stop"  # stop | continue (hpcdl.comm.ulfm; needs mpirun --with-ft ulfm)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def params_sync_every(self) -> int:
        """K for --sync params:K, 0 for --sync grad."""
        return 0 if self.sync == "grad" else int(self.sync.split(":")[1])

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d.pop("extra")
        return json.dumps(d, sort_keys=True)


_CHOICES = {
    "lr_scaling": ("none", "linear"),
    "lr_decay": ("none", "cosine", "step"),
    "optimizer": ("sgd", "adam", "adamw"),
    "precision": ("fp32", "bf16", "fp16"),
    "device": ("cpu", "gpu"),
    "decode": ("cpu", "gpu"),
    "shuffle": ("global", "node", "none"),
    "peer_staging": PEER_MODES,
    "peer_ranges": PEER_MODES,
    "progress": PROGRESS_MODES,
    "on_node_loss": ("stop", "continue"),
}
_WORD_OR_INT = ("stage_nice", "prefetch")  # a word or a number: TOML may give either
_POSITIVE_INT = ("epochs", "batch_size", "metrics_every", "stage_threads")
_NON_NEGATIVE = ("warmup_epochs", "momentum", "weight_decay", "checkpoint_every", "seed")
# Help per flag, with units. build_parser appends "(default: X)" from TrainConfig unless the
# text already names the default (always the case where the default is None).
_HELP = {
    "data": "training data: HDF5 file, directory of HDF5 shards, WebDataset tar shards (a "
    "directory of *.tar, or a pattern 'shard-{000000..000099}.tar'), or image folder "
    "root/<class>/ (required; no default)",
    "val_data": "validation data (same kinds as --data) (default: none, no validation)",
    "model": f"{', '.join(MODELS)}, or your own: package.module:function or "
    "path/to/file.py:function returning an hpcdl.nn.Model (docs/nn.md) or a torch.nn.Module, "
    "or torchvision:NAME, one of torchvision's image classifiers (docs/torch.md)",
    "epochs": "passes over the training data",
    "batch_size": "minibatch size per rank, in samples (global batch = ranks x this)",
    "lr": "base learning rate (before --lr-scaling)",
    "lr_scaling": "none, or linear: lr x global batch / --base-batch (Goyal et al.)",
    "base_batch": "reference batch in samples for --lr-scaling linear (default: --batch-size)",
    "warmup_epochs": "epochs (fractions allowed) of linear learning-rate warm-up to --lr",
    "lr_decay": "learning-rate decay after warm-up: none, cosine, or step (x0.1 at 50%% and "
    "75%% of the epochs)",
    "optimizer": "sgd (PyTorch form), adam, or adamw (decoupled weight decay)",
    "momentum": "SGD momentum (default: 0.9; PyTorch's and Keras's SGD default to 0); adam and "
    "adamw use betas 0.9, 0.999",
    "nesterov": "Nesterov momentum for sgd",
    "weight_decay": "sgd, adam: L2 added to the gradient, g + wd*p (PyTorch's weight_decay); "
    "adamw: decoupled, p *= 1 - lr*wd",
    "decay_bias_norm": "apply weight decay to biases and BatchNorm parameters too (default: on, "
    "as PyTorch; --no-decay-bias-norm leaves them out, as ResNet/ImageNet recipes do)",
    "sync_bn": "BatchNorm batch statistics over all ranks (SyncBatchNorm): R ranks x batch B "
    "train as 1 rank x R*B (default: off: statistics per rank, as DDP without SyncBatchNorm)",
    "precision": "fp32; or bf16 / fp16: activations and gradients rounded to that format, "
    "float32 master weights, fp16 with dynamic loss scaling (an overflow skips the step on every "
    "rank). The arrays stay float32: this gives the format's accuracy, not its speed "
    "(docs/precision.md)",
    "gpu_kernels": "opt in to the fast kernels of hpcdl.nn.kernels (counter-based dropout; on a "
    "GPU, cuDNN graphs) before a recorded GPU run makes them the default (default: off; "
    "HPCDL_GPU_KERNELS=1 does the same)",
    "tf32": "on a GPU, let float32 convolutions and matrix products run on TF32 tensor cores "
    "(10-bit mantissa products, float32 sums): hpcdl's engine with --gpu-kernels (cuDNN "
    "convolutions, GEMMs), a torch model through torch.backends' fp32_precision. Default: "
    "IEEE float32 in hpcdl's engine; a torch model keeps PyTorch's own defaults (TF32 "
    "convolutions, IEEE matmuls) (docs/precision.md, TF32)",
    "device": "cpu (NumPy) or gpu (CuPy; one GPU per rank, local rank modulo visible GPUs)",
    "seed": "seed of initialisation, shuffling and augmentation, 0..2**63-1",
    "shuffle": "global: one permutation over all ranks per epoch; node: samples stay on their "
    "node (less staging traffic); none: fixed order",
    "sync": "grad: allreduce gradients every step; params:K: average parameters every K steps",
    "bucket_mb": "gradient bucket size in MiB for the allreduce that overlaps backward",
    "checkpoint_dir": "directory for HDF5 checkpoints, written at every epoch end and at "
    "--max-steps; the two "
    "newest of this run are kept. Checked writable at start; one that holds an earlier run's "
    "checkpoints needs --resume (default: none, no checkpoints)",
    "checkpoint_every": "also checkpoint every N steps (0: only at epoch ends)",
    "resume": "none, auto (latest checkpoint in --checkpoint-dir if any) or a checkpoint path; "
    "with another number of ranks the global batch is kept and the interrupted epoch finished "
    "with each remaining sample once; a finished run says 'nothing to train' and exits 0",
    "metrics": "write JSON lines (step, epoch, summary events) to this path (default: none)",
    "metrics_every": "write a step record to --metrics every N steps",
    "quiet": "print only the final result line: no start-up lines, no progress (overrides "
    "--progress) (default: off)",
    "progress": "auto: a live bar when the launcher's output is a terminal, else epoch "
    "($HPCDL_PROGRESS, when set, decides for auto; the sbatch templates set epoch); "
    "bar: Keras-style live bar; epoch: one line per epoch (job logs); none: no progress lines",
    "workers": "loader worker processes per rank (0: load in the training process; at most 4 "
    "per core of the node, shared by its ranks) (default: a fair share of the node's cores)",
    "prefetch": "shared-memory batch slots per rank (batches loaded ahead): auto (2 per "
    "worker, at least 4, within 4 GiB and a quarter of the free /dev/shm per node's ranks), "
    "or a number (default: auto)",
    "loader_timeout": "seconds a loader worker may stay silent on a batch the trainer waits for: "
    "a warning at half, then the job stops with exit status 4",
    "augment": "augmentation spec, e.g. none, crop4+flip, rrc224+flip (cropP, rcropS, rrcS with "
    "P, S <= 8192)",
    "decode": "cpu: loader workers decode and augment; gpu: workers only read the image files, "
    "the rank decodes them (nvImageCodec on --device gpu; Pillow in the rank elsewhere), crops, "
    "flips and normalises on its device, with the same crop boxes (docs/training.md)",
    "skip_bad_samples": "replace an unreadable sample by the nearest good one of its batch "
    "instead of stopping (counted in the summary) (default: off)",
    "index_in_data_root": "cache an image folder's index in the data directory itself "
    "(.hpcdl-index, mode 0444) for every user of the data set; without it the index goes to "
    "$XDG_CACHE_HOME/hpcdl (default ~/.cache/hpcdl) and the data directory is left alone "
    "(default: off)",
    "stage_dir": "node-local directory to stage training files into (enables staging) "
    "(default: none, read from the data's file system)",
    "stage_threads": f"copy threads of the node's stager, 1..{MAX_THREADS}",
    "stage_nice": "niceness the node's stager adds to the ranks': auto (0 while the ranks wait "
    f"for the run's first epoch, +{STAGE_NICE_LATER} once they pass it), or 0-19 from the start "
    "(10 lets the ranks' steps go first on busy cores; 0: the ranks' priority)",
    "stage_capacity": "bytes (e.g. 200G) or percent of free space (e.g. 80%%) staging may use "
    "(default: all free space)",
    "keep_staged": "leave staged files in --stage-dir at the end for a later job (default: off)",
    "stage_verify": "compare each staged copy with its source (FNV-1a checksum) (default: off)",
    "peer_staging": "nodes fetch staged files from the node that staged them first instead of "
    "the PFS; auto: on with 2 or more nodes and --shuffle global (default: auto)",
    "peer_ranges": "with tar shards and the peer tier, a node fetches only its samples' bytes of "
    "a shard from the shard's home; auto: for a shard whose samples the node reads are under "
    "half its bytes; on: every shard; off: whole shards (default: auto)",
    "max_steps": "stop after this many steps in total (default: none, run all epochs)",
    "init_from": "start from these weights: a PyTorch state dict (.pth/.pt, torchvision's names "
    "for resnet18/50) or a .safetensors file; a classifier of another class count is "
    "re-initialised (docs/models.md) (default: none, --seed's initialisation)",
    "tensorboard": "write TensorBoard event files (loss, accuracy, lr, images/s, step-time "
    "split, validation, staging, loss scale) to this directory from rank 0; needs tensorboardX "
    "(docs/training.md) (default: none)",
    "stall_warning": "seconds a rank may wait in a collective or for its loader before it names "
    "the ranks it waits for, and what each was last doing (docs/diagnose.md)",
    "stall_shutdown": "end the job this many seconds after a stall warning, with exit status 5 "
    "and every waiting rank's flight record (docs/reliability.md) (default: none, wait)",
    "on_node_loss": "stop: a lost rank ends the job (resume with --resume auto); continue: "
    "the survivors go on in the same job from the latest checkpoint, with the global batch "
    "kept; needs --checkpoint-dir and `mpirun --with-ft ulfm`, and survives lost ranks, not a "
    "lost node's MPI daemon (docs/reliability.md)",
    "timeline": "write every rank's events (data wait, forward, backward, each bucket's "
    "allreduce, optimizer, evaluation, checkpoints, signals) on one clock to this Chrome trace "
    "file, for Perfetto or chrome://tracing (docs/diagnose.md) (default: none)",
}


def _help(f: dataclasses.Field) -> str:
    """The flag's help with its default (and the help of a field nobody described: a bug)."""
    text = _HELP[f.name]
    if "default" in text:
        return text
    default = f.default
    if isinstance(default, bool):
        default = "on" if default else "off"
    elif isinstance(default, float):
        default = f"{default:g}"
    return f"{text} (default: {default})"


def progress_from_env(environ: Mapping[str, str]) -> str | None:
    """$HPCDL_PROGRESS, which decides what --progress auto means (hpcdl.metrics), or None."""
    value = environ.get("HPCDL_PROGRESS")
    if value is not None and value not in PROGRESS_MODES:
        raise ConfigError(
            f"HPCDL_PROGRESS must be one of {', '.join(PROGRESS_MODES)}, got {value!r}"
        )
    return value


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _field_type(f: dataclasses.Field) -> type:
    text = str(f.type)
    for name, typ in (("bool", bool), ("int", int), ("float", float)):
        if text.startswith(name):
            return typ
    return str


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing and exiting on every rank."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def build_parser(prog: str = "python -m hpcdl.train") -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description="Data-parallel training under MPI.", allow_abbrev=False)
    parser.add_argument(
        "--config",
        help="TOML file whose keys are these flags with underscores; flags override it",
    )
    for f in dataclasses.fields(TrainConfig):
        if f.name == "extra":
            continue
        typ = _field_type(f)
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": _help(f)}
        if typ is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = str  # converted and validated in one place, with our messages
            if f.name in _CHOICES:
                kwargs["metavar"] = "{" + ",".join(_CHOICES[f.name]) + "}"
            elif f.name == "model":
                kwargs["metavar"] = "{" + ",".join(MODELS) + "}|MODULE:FUNCTION"
        parser.add_argument(_flag(f.name), **kwargs)
    return parser


def field_types() -> dict[str, type]:
    """TrainConfig's fields (the flags with underscores) -> bool, int, float or str, the type
    convert_value makes of a flag's or a TOML key's value."""
    return {f.name: _field_type(f) for f in dataclasses.fields(TrainConfig) if f.name != "extra"}


def convert_value(name: str, value: Any, typ: type, source: str) -> Any:
    """`value` of flag or key `name` as `typ` (bool, int, float, str; object: as given, for its
    user to check); ConfigError naming the flag and `source` (the config file, "command line")
    when it is of another type, or an empty path (empty_path_error)."""
    where = f"{_flag(name)} ({source})"
    if value is None or typ is object:
        return value
    if value == "" and name in PATH_KEYS:
        raise ConfigError(empty_path_error(name, source))
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if typ is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be an integer, got {value!r}") from None
    if typ is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be a number, got {value!r}") from None
    if name in _WORD_OR_INT and isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # stage_nice = 10 in TOML means "10"
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a string, got {value!r}")
    return value


def toml_values(
    path: str, types: Mapping[str, type], ignore_unknown: bool = False
) -> dict[str, Any]:
    """The keys of TOML file `path` (dashes read as underscores), each converted by
    convert_value to its type in `types`, relative paths made relative to the file
    (resolve_paths). A key not in `types` is a ConfigError, or left out with ignore_unknown
    (hpcdl.stage reads the training job's file, which holds keys it has no use for)."""
    values: dict[str, Any] = {}
    spelled: dict[str, str] = {}  # name -> the key that gave it
    for key, value in load_toml(path).items():
        name = key.replace("-", "_")
        if name in spelled:
            raise ConfigError(
                f"config file {path}: {spelled[name]} and {key} are the same setting "
                f"({_flag(name)}); keep one"
            )
        spelled[name] = key
        if name in types:
            values[name] = convert_value(name, _typed_in_toml(name, value, types[name], path),
                                         types[name], path)  # fmt: skip
        elif not ignore_unknown:
            raise ConfigError(f"config file {path}: unknown key {key!r}")
    return resolve_paths(values, path)


def _typed_in_toml(name: str, value: Any, typ: type, path: str) -> Any:
    """`value` as TOML typed it: a number key holding a number in a string (`lr = "0.1"`) is a
    ConfigError, as the command line's strings are not (argparse hands convert_value strings)."""
    if typ in (int, float) and isinstance(value, str):
        kind = "an integer" if typ is int else "a number"
        try:
            typ(value)
        except ValueError:  # not a number at all: convert_value says so
            return value
        raise ConfigError(
            f"{_flag(name)} (config file {path}) must be {kind}, not the string {value!r}; "
            f"write it without quotes"
        )
    return value


def load_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except PermissionError:
        raise ConfigError(f"config file {path} is not readable (permission denied)") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory, expected a TOML file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Build a validated TrainConfig from flags and an optional TOML file."""
    args = build_parser().parse_args(argv)
    if args.config == "":
        raise ConfigError(empty_path_error("config", "command line"))
    types = field_types()
    values = toml_values(args.config, types) if args.config else {}
    for name, typ in types.items():
        flag_value = getattr(args, name)
        if flag_value is not None:
            values[name] = convert_value(name, flag_value, typ, "command line")
    cfg = TrainConfig(**values)
    validate(cfg)
    return cfg


def validate(cfg: TrainConfig) -> None:
    if not cfg.data:
        raise ConfigError("--data is required: a path to HDF5 shards or an image folder")
    for name, allowed in _CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise ConfigError(
                f"{_flag(name)} must be one of {', '.join(allowed)}, got {getattr(cfg, name)!r}"
            )
    _validate_model(cfg.model)
    for name, typ in field_types().items():  # inf and nan fail at step 1 or never end a wait
        value = getattr(cfg, name)
        if typ is float and value is not None and not math.isfinite(value):
            raise ConfigError(f"{_flag(name)} must be a finite number, got {value}")
    for name in _POSITIVE_INT:
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{_flag(name)} must be a positive integer, got {getattr(cfg, name)}")
    for name in _NON_NEGATIVE:
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{_flag(name)} must be >= 0, got {getattr(cfg, name)}")
    if cfg.seed > MAX_SEED:
        raise ConfigError(f"--seed must be 0..{MAX_SEED} (2**63 - 1), got {cfg.seed}")
    if not cfg.lr >= 0:  # 0 freezes the model, as PyTorch and Keras allow (startup says so)
        raise ConfigError(f"--lr must be >= 0, got {cfg.lr}")
    if not cfg.bucket_mb > 0:
        raise ConfigError(f"--bucket-mb must be > 0, got {cfg.bucket_mb}")
    if cfg.workers is not None and cfg.workers < 0:
        raise ConfigError(f"--workers must be >= 0, got {cfg.workers}")
    if not cfg.loader_timeout > 0:
        raise ConfigError(f"--loader-timeout must be > 0 seconds, got {cfg.loader_timeout}")
    if cfg.base_batch is not None and cfg.base_batch < 1:
        raise ConfigError(f"--base-batch must be a positive integer, got {cfg.base_batch}")
    if not cfg.stall_warning > 0:
        raise ConfigError(f"--stall-warning must be > 0 seconds, got {cfg.stall_warning}")
    if cfg.stall_shutdown is not None and not cfg.stall_shutdown > 0:
        raise ConfigError(f"--stall-shutdown must be > 0 seconds, got {cfg.stall_shutdown}")
    if cfg.timeline is not None and Path(cfg.timeline).is_dir():
        raise ConfigError(
            f"--timeline {cfg.timeline} is a directory; give a file name such as "
            f"{Path(cfg.timeline) / 'trace.json'}"
        )
    if cfg.max_steps is not None and cfg.max_steps < 1:
        raise ConfigError(f"--max-steps must be a positive integer, got {cfg.max_steps}")
    try:
        parse_augment(cfg.augment)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.progress == "auto":
        progress_from_env(os.environ)
    _validate_models_io(cfg)
    _validate_spelled(cfg)
    _validate_resume(cfg)


def _validate_spelled(cfg: TrainConfig) -> None:
    """The fields that take a word or a number in one string."""
    if cfg.prefetch != "auto" and not (
        cfg.prefetch.isascii() and cfg.prefetch.isdigit() and int(cfg.prefetch) >= 1
    ):
        raise ConfigError(f"--prefetch must be auto or an integer >= 1, got {cfg.prefetch!r}")
    if cfg.stage_nice != "auto" and not (
        cfg.stage_nice.isascii() and cfg.stage_nice.isdigit() and int(cfg.stage_nice) <= 19
    ):
        raise ConfigError(f"--stage-nice must be auto or 0..19, got {cfg.stage_nice!r}")
    if not re.fullmatch(r"grad|params:[1-9][0-9]*", cfg.sync):
        raise ConfigError(f"--sync must be 'grad' or 'params:K' with K >= 1, got {cfg.sync!r}")
    error = stage_flags_error(cfg.stage_threads, cfg.stage_capacity)  # the stager's ranges
    if error:
        raise ConfigError(error)


def _validate_resume(cfg: TrainConfig) -> None:
    """What a run goes on from: a checkpoint file, or the checkpoint directory."""
    if cfg.resume not in ("none", "auto") and not Path(cfg.resume).is_file():
        raise ConfigError(f"--resume {cfg.resume}: no such checkpoint file (or use auto/none)")
    if cfg.on_node_loss == "continue" and not cfg.checkpoint_dir:
        raise ConfigError("--on-node-loss continue needs --checkpoint-dir to go on from")
    if cfg.resume == "auto" and not cfg.checkpoint_dir:
        raise ConfigError("--resume auto needs --checkpoint-dir to look for checkpoints in")


def _validate_model(model: str) -> None:
    """A built-in name, a user's builder that imports (called later, with the data's shape), or
    torchvision:NAME with torch and torchvision installed (the name is looked up later)."""
    if is_torchvision(model):
        for package, install in (("torch", "'hpcdl[torch]'"), ("torchvision", "torchvision")):
            if not _installed(package):
                raise ConfigError(
                    f"--model {model} needs {package}, which is not installed: pip install "
                    f"{install}"
                )
    elif is_user_model(model):
        try:
            load_builder(model)
        except ValueError as exc:
            raise ConfigError(f"--{exc}") from None
    elif model not in MODELS:
        raise ConfigError(
            f"--model must be one of {', '.join(MODELS)}, package.module:function / "
            f"path/to/file.py:function, or torchvision:NAME, got {model!r}"
        )


def _installed(package: str) -> bool:
    """package can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a broken install, or one blocked in sys.modules
        return False


def _validate_models_io(cfg: TrainConfig) -> None:
    """--init-from names a weights file hpcdl reads; --tensorboard has tensorboardX."""
    from hpcdl.nn.weights_io import WEIGHT_SUFFIXES  # noqa: PLC0415

    if cfg.init_from is not None:
        if Path(cfg.init_from).is_dir():
            raise ConfigError(
                f"--init-from {cfg.init_from} is a directory; give a weights file in it"
            )
        if not Path(cfg.init_from).is_file():
            raise ConfigError(f"--init-from {cfg.init_from}: no such file")
        if Path(cfg.init_from).suffix not in WEIGHT_SUFFIXES:
            raise ConfigError(
                f"--init-from {cfg.init_from}: expected a {', '.join(WEIGHT_SUFFIXES)} file"
            )
    if cfg.tensorboard is not None:
        if Path(cfg.tensorboard).exists() and not Path(cfg.tensorboard).is_dir():
            raise ConfigError(f"--tensorboard {cfg.tensorboard} is a file; give a directory")
        try:
            import tensorboardX  # noqa: F401, PLC0415
        except ImportError:
            raise ConfigError(
                "--tensorboard needs tensorboardX, which is not installed: "
                "pip install 'hpcdl[tensorboard]'"
            ) from None
