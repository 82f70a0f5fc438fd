"""hpcdl.train's run hands its loader the next epoch (issue 48; hpcdl.data.pool NOTE [the next
epoch]): the workers go on into epoch e + 1 while the last steps of e run, and the last epoch
asks for nothing beyond. The control channel counts one TASK and one REPLY per batch built and
one READY per worker, so its count says whether a batch was built ahead, and none twice."""

from hpcdl.comm.world import init_world
from hpcdl.config import parse_args, validate
from hpcdl.startup import start_run

WORKERS = 2


def test_the_run_builds_the_next_epochs_first_batches_while_this_one_ends(digits_dir):
    cfg = parse_args(
        ["--data", str(digits_dir / "train"), "--epochs", "2", "--batch-size", "64"]
        + ["--workers", str(WORKERS), "--quiet"]
    )
    validate(cfg)
    with start_run(cfg, init_world()) as run:
        n = run.steps_per_epoch

        def messages() -> int:
            return run.loader.stats()["control_messages"]

        for _ in run.batches(0):
            pass
        assert messages() > 2 * n + WORKERS  # epoch 1's first batches are under way
        epoch1 = [labels.copy() for _, labels in run.batches(1)]
        assert messages() == 2 * 2 * n + WORKERS  # they were used, none built twice
        assert len(epoch1) == n
        for _ in run.batches(1):  # the last epoch again: nothing built beyond it
            pass
        assert messages() == 3 * 2 * n + WORKERS
