"""hpcdl.train with a torch.nn.Module (hpcdl.torch_engine, NOTE [the engine seam]): real
2-rank runs under mpirun on the digits data; the model is tests/torch_models.py's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    make_folder,
    mpi_env,
    rank_pid,
    read_events,
    run_train,
    train_cmd,
    wait_until,
)

from hpcdl import checkpoint

torch = pytest.importorskip("torch")

MODELS = Path(__file__).parent / "torch_models.py"
CNN = f"{MODELS}:small_cnn"


def args(digits: Path, *more) -> list:
    return ["--data", digits / "train", "--model", CNN, "--batch-size", 16, "--lr", 0.05,
            "--workers", 0, "--seed", 3, "--progress", "none", *more]  # fmt: skip


def final_state(ckpt_dir: Path) -> checkpoint.Checkpoint:
    return checkpoint.load(checkpoint.latest(ckpt_dir))


@pytest.fixture(scope="module")
def uninterrupted(digits_dir, tmp_path_factory):
    """uninterrupted(*flags): the checkpoint dir of a 2-rank run of args(flags) that nothing
    stopped, run once per module for each set of flags (SIGTERM's and SIGKILL's test compare
    with the same run: 4-5 s of CI each)."""
    done: dict[tuple[str, ...], Path] = {}

    def run(*flags) -> Path:
        key = tuple(map(str, flags))
        if key not in done:
            whole = tmp_path_factory.mktemp("whole")
            first = run_train(2, *args(digits_dir, *flags, "--checkpoint-dir", whole), timeout=300)
            assert first.returncode == 0, first.stderr[-3000:]
            done[key] = whole
        return done[key]

    return run


def test_backward_hands_growing_gradient_prefixes_to_the_reducer_as_it_goes():
    """FlatModule: autograd writes into the flat gradient vector (the reducer's buffer), and
    the hooks report final prefixes while backward runs, not only at its end."""
    import copy  # noqa: PLC0415

    import torch_models  # noqa: PLC0415 (tests/ is on the path, as helpers is)

    from hpcdl.config import TrainConfig  # noqa: PLC0415
    from hpcdl.torch_engine.flat import FlatModule  # noqa: PLC0415

    torch.manual_seed(0)
    module = torch_models.small_cnn((1, 8, 8), 10)
    reference = copy.deepcopy(module)
    flat = FlatModule(module, TrainConfig(data="x", model=CNN), (1, 8, 8), 10)
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))
    marks: list[int] = []
    flat.begin_backward(marks.append)
    torch.manual_seed(1)
    torch.nn.functional.cross_entropy(module(x), y).backward()
    torch.manual_seed(1)
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    total = flat.params.size
    assert marks == sorted(marks) and len(set(marks)) > 1 and marks[-1] == total
    assert marks[0] < total  # the last layer's gradients were final before backward ended
    grads = dict(reference.named_parameters())
    for (name, shape, offset), size in zip(flat.layout(), map(np.prod, flat.shapes)):
        got = flat.grads_and_flags[offset : offset + int(size)].view(shape)
        assert torch.equal(got, grads[name].grad), name


def test_two_ranks_train_a_torch_module_to_identical_parameters(digits_dir, tmp_path):
    digests = tmp_path / "digests"
    digests.mkdir()
    done = run_train(2, *args(digits_dir, "--epochs", 2, "--val-data", digits_dir / "val",
                              "--metrics", tmp_path / "m.jsonl", "--checkpoint-dir",
                              tmp_path / "ck"),
                     env={**mpi_env(), "HPCDL_TORCH_DIGESTS": str(digests)},
                     timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1].startswith("hpcdl.train: final val_acc "), done.stdout
    assert float(lines[-1].split()[3]) > 0.8, done.stdout  # it learned: digits at 2 epochs
    finals = [(digests / f"rank-{r}.txt").read_text().split()[-1] for r in range(2)]
    assert finals[0] == finals[1]  # parameters and BatchNorm statistics, bit for bit
    epochs = read_events(tmp_path / "m.jsonl", "epoch")
    assert [e["epoch"] for e in epochs] == [0, 1] and all("val_acc" in e for e in epochs)
    steps = read_events(tmp_path / "m.jsonl", "step")
    assert steps and all(s["lr"] == 0.05 and np.isfinite(s["loss"]) for s in steps)
    saved = final_state(tmp_path / "ck")
    assert saved.model == "torch_models:small_cnn" and saved.global_step == 2 * 44
    assert sorted(saved.optimizer) == ["momentum_buffer", "updates"]


def test_sync_params_k_ends_with_identical_parameters_on_every_rank(digits_dir, tmp_path):
    """--sync params:4: local steps, the parameters averaged every 4th; at step 8 equal."""
    digests = tmp_path / "digests"
    digests.mkdir()
    done = run_train(2, *args(digits_dir, "--epochs", 1, "--sync", "params:4", "--max-steps", 8,
                              "--val-data", digits_dir / "val"),
                     env={**mpi_env(), "HPCDL_TORCH_DIGESTS": str(digests)},
                     timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    finals = [(digests / f"rank-{r}.txt").read_text().split() for r in range(2)]
    assert finals[0][-1] == finals[1][-1]  # after the averaging at step 8
    assert finals[0][0] != finals[0][-1]  # it trained


def test_bf16_trains_under_autocast_to_identical_parameters(digits_dir, tmp_path):
    digests = tmp_path / "digests"
    digests.mkdir()
    done = run_train(2, *args(digits_dir, "--epochs", 1, "--precision", "bf16", "--val-data",
                              digits_dir / "val", "--progress", "epoch"),
                     env={**mpi_env(), "HPCDL_TORCH_DIGESTS": str(digests)},
                     timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hpcdl: precision bf16: forward and loss under torch.autocast" in done.stdout
    assert float(done.stdout.splitlines()[-1].split()[3]) > 0.5, done.stdout  # val_acc
    finals = [(digests / f"rank-{r}.txt").read_text().split()[-1] for r in range(2)]
    assert finals[0] == finals[1]


def test_the_learning_rate_of_every_step_is_the_hpcdl_engines(digits_dir, tmp_path):
    """The same schedule flags give the same learning rate at every step with either engine."""
    flags = ("--epochs", 2, "--max-steps", 60, "--metrics-every", 1, "--warmup-epochs", 0.5,
             "--lr-decay", "cosine", "--lr-scaling", "linear", "--base-batch", 8)  # fmt: skip
    rates = {}
    for model in (CNN, "mlp"):
        metrics = tmp_path / f"{model[-3:]}.jsonl"
        done = run_train(2, *args(digits_dir, *flags, "--model", model, "--metrics", metrics),
                         timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        rates[model] = [s["lr"] for s in read_events(metrics, "step")]
    assert len(rates[CNN]) == 60 and rates[CNN] == rates["mlp"]
    assert len(set(rates[CNN])) > 30  # warm-up and decay: it changes step by step


@pytest.mark.parametrize(
    ("optimizer", "sync_bn"),
    [("sgd", []), ("adamw", []), ("sgd", ["--sync-bn"])],
    ids=["sgd", "adamw", "sgd-sync-bn"],
)
def test_resume_auto_after_a_stop_between_checkpoints_is_bitwise_an_uninterrupted_run(
    digits_dir, tmp_path, optimizer, sync_bn
):
    """Stopped by --max-steps 7 with checkpoints every 5 steps and at the stop: the resumed run
    goes on from step 7's checkpoint (model, optimizer, dropout generators, BatchNorm counters)
    and ends with the parameters and optimizer state of a run that was never stopped, bit for bit.
    With --sync-bn every rank's BatchNorm statistics are the same, so those are bitwise too."""
    common = ("--epochs", 2, "--optimizer", optimizer, "--weight-decay", 1e-4,
              "--checkpoint-every", 5, "--lr-decay", "cosine", "--warmup-epochs", 0.5,
              *sync_bn)  # fmt: skip
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    first = run_train(2, *args(digits_dir, *common, "--checkpoint-dir", whole), timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    stopped = run_train(2, *args(digits_dir, *common, "--checkpoint-dir", cut, "--max-steps", 7),
                        timeout=300)  # fmt: skip
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert final_state(cut).global_step == 7
    resumed = run_train(2, *args(digits_dir, *common, "--checkpoint-dir", cut, "--resume", "auto"),
                        timeout=300)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "hpcdl: resumed at epoch 1, step 7 (auto)" in resumed.stdout
    a, b = final_state(whole), final_state(cut)
    assert a.global_step == b.global_step == 88
    assert a.params.tobytes() == b.params.tobytes()
    # Without --sync-bn BatchNorm's running statistics are not bitwise: a checkpoint holds
    # rank 0's (as with hpcdl's own models), so rank 1 resumed from rank 0's at step 7; they
    # never enter the training forward, and the epoch-end averaging brings them within rounding
    if sync_bn:
        assert a.buffers.tobytes() == b.buffers.tobytes()
    else:
        np.testing.assert_allclose(a.buffers, b.buffers, rtol=1e-3, atol=1e-4)
    assert sorted(a.optimizer) == sorted(b.optimizer)
    for key in a.optimizer:
        assert np.asarray(a.optimizer[key]).tobytes() == np.asarray(b.optimizer[key]).tobytes()
    assert a.rng_states == b.rng_states


@pytest.mark.parametrize(
    ("sig", "sync_bn"),
    [(signal.SIGTERM, []), (signal.SIGKILL, []), (signal.SIGKILL, ["--sync-bn"])],
    ids=["SIGTERM", "SIGKILL", "SIGKILL-sync-bn"],
)
def test_resume_auto_after_a_signal_to_one_rank_is_bitwise_an_uninterrupted_run(
    digits_dir, tmp_path, sig, sync_bn, uninterrupted
):
    """SIGTERM to rank 1: the job stops with a checkpoint at the agreed step (exit 3).
    SIGKILL to rank 1 once step 10's checkpoint exists: the job ends, the checkpoint stays.
    Either way `--resume auto` ends with the uninterrupted run's parameters, bit for bit (with
    --sync-bn, its BatchNorm statistics too: every rank's are the same)."""
    common = ("--epochs", 2, "--checkpoint-every", 10, "--metrics-every", 1, *sync_bn)
    whole, cut = uninterrupted(*common), tmp_path / "cut"
    env = {**mpi_env(), "HPCDL_TORCH_SLOW": "0.05", "HPCDL_TEST_MARKER": str(cut)}
    metrics = tmp_path / "cut.jsonl"
    cmd = train_cmd(2, *args(digits_dir, *common, "--checkpoint-dir", cut, "--metrics", metrics))
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=env)  # fmt: skip
    try:
        wait_until(lambda: checkpoint.latest(cut) is not None and metrics.exists()
                   and len(read_events(metrics, "step")) >= 13, timeout=120,
                   what="step 13, after step 10's checkpoint")  # fmt: skip
        os.kill(rank_pid(str(cut), 1), sig)
        out, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode != 0
    if sig == signal.SIGTERM:
        assert "hpcdl.train: stopped by signal SIGTERM, checkpoint at" in out, out + err
    stopped_at = final_state(cut).global_step
    assert 10 <= stopped_at < 88
    resumed = run_train(2, *args(digits_dir, *common, "--checkpoint-dir", cut, "--resume", "auto"),
                        timeout=300)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = final_state(whole), final_state(cut)
    assert a.global_step == b.global_step == 88
    assert a.params.tobytes() == b.params.tobytes()
    assert not sync_bn or a.buffers.tobytes() == b.buffers.tobytes()
    for key in a.optimizer:
        assert np.asarray(a.optimizer[key]).tobytes() == np.asarray(b.optimizer[key]).tobytes()


def one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("hpcdl.train: error")]
    assert len(errors) == 1, done.stderr
    return errors[0]


@pytest.mark.parametrize(
    ("flag", "said"),
    [
        (["--gpu-kernels"], "--gpu-kernels is not supported with a torch model"),
    ],
)
def test_a_flag_the_torch_engine_does_not_serve_is_refused_in_one_line(digits_dir, flag, said):
    done = run_train(2, *args(digits_dir, "--epochs", 1, *flag), timeout=120)
    assert said in one_line_error(done)


def test_a_builder_returning_neither_kind_of_model_is_one_line(digits_dir):
    spec = f"{MODELS}:not_a_model"
    done = run_train(2, *args(digits_dir, "--epochs", 1, "--model", spec), timeout=120)
    assert "the builder returned a str; it must be a function(" in one_line_error(done)
    assert "or a torch.nn.Module" in done.stderr


def test_init_from_a_state_dict_that_does_not_fit_is_one_line(digits_dir, tmp_path):
    weights = tmp_path / "other.pth"
    torch.save({"conv.weight": torch.zeros(8, 1, 5, 5), "extra": torch.zeros(2)}, weights)
    done = run_train(2, *args(digits_dir, "--epochs", 1, "--init-from", weights), timeout=120)
    line = one_line_error(done)
    assert f"--init-from {weights} does not fit --model's state dict: missing " in line
    assert "unexpected extra" in line
    assert "conv.weight is (8, 1, 5, 5) in the file, (8, 1, 3, 3) in the model" in line


def test_init_from_a_fitting_state_dict_starts_from_its_weights(digits_dir, tmp_path):
    import torch_models  # noqa: PLC0415 (tests/ is on the path, as helpers is)

    module = torch_models.small_cnn((1, 8, 8), 10)
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.fill_(0.01 * (i + 1))
    weights = tmp_path / "mine.pth"
    torch.save(module.state_dict(), weights)
    done = run_train(2, *args(digits_dir, "--epochs", 1, "--init-from", weights, "--lr", 0,
                              "--max-steps", 1, "--checkpoint-every", 1, "--checkpoint-dir",
                              tmp_path / "ck"), timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    saved = final_state(tmp_path / "ck")
    offset = 0
    for name, shape in saved.layout:  # --lr 0: the parameters are the file's
        n = int(np.prod(shape))
        expected = module.state_dict()[name].numpy().reshape(-1)
        assert np.array_equal(saved.params[offset : offset + n], expected), name
        offset += n
    # resumed, the run takes its weights from the checkpoint and says so (as hpcdl's engine)
    again = run_train(2, *args(digits_dir, "--epochs", 1, "--init-from", weights, "--lr", 0,
                               "--max-steps", 2, "--checkpoint-dir", tmp_path / "ck", "--resume",
                               "auto"), timeout=120)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"hpcdl: --init-from {weights} not read: resuming from" in again.stdout


def test_init_from_weights_of_another_class_count_re_initialises_the_head(digits_dir, tmp_path):
    """A fine-tune: the file's classifier has 1000 classes, the data 10; the rest is loaded."""
    import torch_models  # noqa: PLC0415 (tests/ is on the path, as helpers is)

    module = torch_models.small_cnn((1, 8, 8), 1000)
    with torch.no_grad():
        module.conv.weight.fill_(0.5)
    weights = tmp_path / "pretrained.pth"
    torch.save(module.state_dict(), weights)
    done = run_train(2, *args(digits_dir, "--epochs", 1, "--init-from", weights, "--lr", 0,
                              "--max-steps", 1, "--checkpoint-every", 1, "--checkpoint-dir",
                              tmp_path / "ck"), timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        f"hpcdl: {weights}: head.weight is (1000, 128) there, (10, 128) here: the final layer is "
        "re-initialised for 10 classes"
    ) in done.stdout.splitlines(), done.stdout
    saved = final_state(tmp_path / "ck")
    offset = 0
    for name, shape in saved.layout:
        n = int(np.prod(shape))
        if name == "conv.weight":
            assert np.all(saved.params[offset : offset + n] == 0.5)
        offset += n


def test_torchvision_names_without_torchvision_say_what_to_install(digits_dir):
    try:
        import torchvision  # noqa: F401, PLC0415

        pytest.skip("torchvision is installed here")
    except ImportError:
        pass
    done = subprocess.run(
        [sys.executable, "-m", "hpcdl.train", *map(str, args(digits_dir, "--model",
                                                             "torchvision:resnet18"))],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert (
        "--model torchvision:resnet18 needs torchvision, which is not installed: pip install "
        "torchvision"
    ) in done.stderr


@pytest.mark.parametrize("model", [CNN, "torchvision:resnet18"])
def test_a_torch_model_without_torch_installed_names_the_extra(digits_dir, model):
    """torch hidden from the process (as if not installed): one line naming hpcdl[torch]."""
    argv = ["hpcdl.train", *map(str, args(digits_dir, "--model", model))]
    code = (
        "import sys; sys.modules['torch'] = None; sys.argv = " + repr(argv) + "; "
        "from hpcdl.train import main; sys.exit(main())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "torch, which is not installed: pip install 'hpcdl[torch]'" in done.stderr


@pytest.mark.torchvision
def test_torchvision_names_train_and_an_unknown_one_is_one_line(tmp_path):
    """Needs torchvision beside torch (not in the default test venv: docs/torch.md). A
    torchvision builder trains on a folder of small RGB images; a name torchvision.models
    lacks is one line."""
    pytest.importorskip("torchvision")
    folder = tmp_path / "imgs"
    make_folder(folder, per_class=16, size=(32, 32))
    common = ["--data", folder, "--batch-size", 4, "--workers", 0, "--epochs", 1,
              "--progress", "none"]  # fmt: skip
    done = run_train(2, *common, "--model", "torchvision:resnet18", "--max-steps", 2,
                     timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    done = run_train(2, *common, "--model", "torchvision:resnet19", timeout=120)
    assert "torchvision.models has no model 'resnet19'" in one_line_error(done)


def test_a_run_of_hpcdls_own_model_never_imports_torch(digits_dir):
    argv = [str(a) for a in args(digits_dir, "--model", "mlp", "--max-steps", 2)]
    code = (
        f"import sys; from hpcdl.train import main; status = main({argv!r}); "
        "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(status)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=mpi_env(), timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_folder_of_images_with_augment_and_staging_trains_bitwise_as_without(tmp_path):
    """The input side is the engine's business no more than hpcdl's: image folder, --augment,
    loader workers and --stage-dir give a torch model the same batches, so the parameters
    are bitwise those of the same run without staging."""
    folder = tmp_path / "imgs"
    make_folder(folder, per_class=24, size=(20, 20))
    common = ["--data", folder, "--model", CNN, "--augment", "rcrop16+flip", "--epochs", 2,
              "--batch-size", 4, "--workers", 1, "--seed", 3, "--quiet"]  # fmt: skip
    plain = run_train(2, *common, "--checkpoint-dir", tmp_path / "plain", timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    metrics = tmp_path / "staged.jsonl"
    staged = run_train(2, *common, "--checkpoint-dir", tmp_path / "staged", "--stage-dir",
                       tmp_path / "stage", "--metrics", metrics, timeout=300)  # fmt: skip
    assert staged.returncode == 0, staged.stderr[-3000:]
    a, b = final_state(tmp_path / "plain"), final_state(tmp_path / "staged")
    assert a.global_step == b.global_step == 2 * 6
    assert a.params.tobytes() == b.params.tobytes()
    staging = read_events(metrics, "summary")[0]["staging"]
    assert staging["files_staged"] > 0 and staging["hits"] > 0, staging
