"""scripts/gpu_check_summary.py on a GPU run's raw/ folder: each of issue 60's goals judged from
the rows and tests it needs. A goal is met only where all of them are there; a failed row or
test makes it a MISS, one skipped for time or never run leaves it n/a, named. The folders are
built here in the shape of the recorded runs (docs/gpu-runs/), and the script runs as
gpu-check.sh runs it: `python scripts/gpu_check_summary.py RAW OUT`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from xml.sax.saxutils import quoteattr

REPO = Path(__file__).resolve().parents[1]
FLOAT64 = ("tests.test_gpu_path", "test_a_model_computes_the_same_step_on_numpy_and_cupy")
FLOAT64_GK = (
    "tests.test_gpu_float64_kernels",
    "test_the_float64_step_with_the_kernels_matches_numpy",
)
GRAPH = ("tests.test_step_graph", "test_graph_and_plain_steps_give_the_same_parameters_on_the_gpu")
DETERMINISTIC = (
    "tests.test_step_graph",
    "test_two_plain_runs_on_deterministic_engines_give_the_same_bits_on_the_gpu",
)
SEGMENTED = (
    "tests.test_step_graph",
    "test_segmented_graph_and_plain_steps_with_a_reducer_give_the_same_parameters",
)
BATCH = {"cnn": 256, "resnet20": 128, "resnet50": 64}


def compute_row(model: str, precision: str, gk: bool, ratio: float = 0.7, tf32: bool = False):
    """One `bench compute --json` line, as the 2026-11-27 run's compute.jsonl holds them."""
    shape = [3, 224, 224] if model == "resnet50" else [3, 32, 32]
    return dict(model=model, batch_size=BATCH[model], input_shape=shape, device="gpu",
                precision=precision, tf32=tf32, gpu_kernels=gk,
                step_graph="captured" if gk and model != "resnet50" else None,
                hpcdl_ms_per_step=7.0 * ratio, torch_ms_per_step=7.0, ratio=ratio,
                hpcdl_peak_mib=400.0, torch_peak_mib=400.0)  # fmt: skip


def input_row(loader: str, decode: str, workers: int | None, rate: float, wait: float = 0.02,
              model: str = "resnet50", batch: int = 128):  # fmt: skip
    return dict(loader=loader, decode=decode, workers=workers, slots=None, slots_default=True,
                batch=batch, model=model, precision="bf16", device="NVIDIA H200",
                images_per_s=rate, data_wait_share=wait)  # fmt: skip


def junit(cases: list[tuple[tuple[str, str], str, str]]) -> str:
    """pytest's --junitxml text for cases ((classname, test), params, outcome)."""
    body = []
    for (classname, test), params, outcome in cases:
        name = quoteattr(f"{test}[{params}]" if params else test)
        inner = {"passed": "", "failed": '<failure message="assert 1e-06 &lt;= 1e-09">x</failure>',
                 "skipped": '<skipped type="pytest.skip" message="needs CuPy and a GPU">s</skipped>'
                 }[outcome]  # fmt: skip
        body.append(f'<testcase classname="{classname}" name={name} time="0.1">{inner}</testcase>')
    return ('<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests">'
            f'<testsuite name="pytest">{"".join(body)}</testsuite></testsuites>')  # fmt: skip


def passing_tests() -> list[tuple[tuple[str, str], str, str]]:
    return [(FLOAT64, "resnet20-shape0", "passed"), (FLOAT64, "cnn-shape2", "passed"),
            (FLOAT64_GK, "cnn", "passed"), (FLOAT64_GK, "resnet20", "passed"),
            (GRAPH, "cnn-sgd", "passed"), (DETERMINISTIC, "cnn", "passed"),
            (SEGMENTED, "sgd-False", "passed")]  # fmt: skip


def gpu_run(tmp_path: Path) -> tuple[Path, Path, dict]:
    """A lent GPU's raw/ and OUT where every goal has its figure, each met; returns (raw, out,
    parts): parts["phases"] (name -> "rc seconds"), parts["compute"] (phase -> row or None),
    parts["input"] (rows) and parts["tests"] (JUnit cases), which write() puts on disk."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    raw.mkdir(parents=True)
    compute, phases = {}, {}
    for model in ("cnn", "resnet20", "resnet50"):
        for precision in ("fp32", "bf16"):
            for gk in (False, True):
                name = f"compute-{'gk-' if gk else ''}{model}-{precision}"
                compute[name], phases[name] = compute_row(model, precision, gk), "0 12"
    profile = {"profile": {"hpcdl": {"rows": [], "layers_ms": 5.0, "layers_gpu_ms": 3.0,
                                     "plain_step_ms": 6.0}, "torch": None}}  # fmt: skip
    (raw / "profile-gk-cnn-fp32.log").write_text(json.dumps(profile) + "\n")
    phases.update({"profile-gk-cnn-fp32": "0 9", "input": "0 150", "train-tv-resnet50-gpu": "0 40",
                   "tests": "0 80", "tests-mpi": "0 30", "train-ref-cnn-cpu-1": "0 16",
                   "train-cnn-gpu-1": "0 9"})  # fmt: skip
    rows = [input_row("none", "-", None, 3000.0, 0.0), input_row("hpcdl", "gpu", 2, 2900.0),
            input_row("none", "-", None, 2000.0, 0.0, "hpcdl resnet50"),
            input_row("hpcdl.train", "gpu", 2, 1950.0, 0.02, "hpcdl resnet50")]  # fmt: skip
    for workers in (2, 8, 15):
        rows += [input_row("dataloader", "cpu", workers, 1400.0 + workers, 0.04),
                 input_row("hpcdl", "cpu", workers, 1500.0 + workers, 0.03)]  # fmt: skip
    for run, record in (("cnn-gpu-1", {"val_accuracy": 0.98}),
                        ("ref-cnn-cpu-1", {"val_accuracy": 0.979})):  # fmt: skip
        summary = dict(event="summary", steps=660, **record)
        (raw / f"train-{run}.jsonl").write_text(json.dumps(summary) + "\n")
    (raw / "train-tv-resnet50-gpu.jsonl").write_text(torch_engine_run(1500.0))
    return raw, out, {"phases": phases, "compute": compute, "input": rows, "tests": passing_tests()}


def torch_engine_run(rate: float) -> str:
    """The torch engine's metrics as gpu-check.sh runs it: 8 workers, batch 128, a step record
    each of 56 steps, `rate` images/s over steps 7-56 (its summary's rate lower: start-up)."""
    config = {"workers": 8, "batch_size": 128, "metrics_every": 1}
    records = [dict(event="start", time=0.0, global_batch=128, steps_per_epoch=50,
                    config=json.dumps(config))]  # fmt: skip
    records += [dict(event="step", step=k, time=5.0 + k * 128 / rate) for k in range(1, 57)]
    records.append(dict(event="summary", global_batch=128, world_size=1, steps=56,
                        images_per_s=0.8 * rate))  # fmt: skip
    return "".join(json.dumps(r) + "\n" for r in records)


def summarize(raw: Path, out: Path, parts: dict) -> list[str]:
    """Writes parts into raw/ and OUT, runs the summary; its goal lines, each stripped."""
    text = summary_text(raw, out, parts)
    return [line.strip() for line in text[text.index("goals (issue 60)") :].splitlines()[1:]]


def summary_text(raw: Path, out: Path, parts: dict) -> str:
    """Writes parts into raw/ and OUT, runs the summary; what it printed."""
    out.mkdir(exist_ok=True)
    for name, row in parts["compute"].items():
        (raw / f"{name}.log").write_text(json.dumps(row) + "\n" if row else "RuntimeError: x\n")
    (raw / "phases.txt").write_text("".join(f"{k} {v}\n" for k, v in parts["phases"].items()))
    (out / "input.jsonl").write_text("".join(json.dumps(r) + "\n" for r in parts["input"]))
    if parts["tests"] is not None:
        (raw / "tests.xml").write_text(junit(parts["tests"]))
    script = REPO / "scripts" / "gpu_check_summary.py"
    done = subprocess.run([sys.executable, str(script), str(raw), str(out)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def goal(lines: list[str], start: str) -> str:
    (line,) = [line for line in lines if line[5:].startswith(start)]
    return line


def test_a_run_with_every_row_and_test_meets_every_goal_and_says_so_last(tmp_path):
    lines = summarize(*gpu_run(tmp_path))
    assert [line for line in lines if not line.startswith(("met ", "info"))] == []
    assert goal(lines, "compute: every ratio").endswith("0 of 12 miss")
    assert lines[-1].startswith("met  every goal answered in this call")


def test_a_failed_compute_row_is_a_miss_and_one_skipped_for_time_is_named_not_met(tmp_path):
    """The audit's raw/: resnet50 fp32 failed, its gk row cut by the budget; the ten rows there
    all meet their goal. Neither goal they belong to may read "met"."""
    raw, out, parts = gpu_run(tmp_path)
    parts["compute"]["compute-resnet50-fp32"], parts["phases"]["compute-resnet50-fp32"] = (
        None,
        "1 20",
    )
    del parts["compute"]["compute-gk-resnet50-fp32"]
    parts["phases"]["compute-gk-resnet50-fp32"] = "skipped 0"
    lines = summarize(raw, out, parts)
    for start in ("compute: every ratio", "compute: peak memory"):
        line = goal(lines, start)
        assert line.startswith("MISS") and "0 of 10 miss" in line
        assert "failed: resnet50 fp32 (exit 1)" in line
        # gk resnet50 fp32 runs after the goals (AFTER_THE_GOALS): cut, it leaves no gap
        assert "resnet50 fp32 gk" not in line
    assert goal(lines, "compute, graph on (gk)").startswith("met ")  # cnn, resnet20: all there
    parts["phases"]["compute-resnet50-fp32"] = "skipped 0"  # only cut for time: not judged
    skipped = summarize(raw, out, parts)
    line = goal(skipped, "compute: every ratio")
    assert line.startswith("n/a ") and "skipped for time: resnet50 fp32" in line
    assert "resnet50 fp32 gk" not in line
    assert skipped[-1].startswith("MISS every goal answered in this call")
    assert "compute: every ratio" in skipped[-1]


def test_a_row_run_after_the_goals_counts_where_it_ran(tmp_path):
    """gk resnet50 fp32 runs after every goal's rows: cut, it leaves no gap; run, its ratio
    counts towards "every ratio" like the others'."""
    raw, out, parts = gpu_run(tmp_path)
    parts["compute"]["compute-gk-resnet50-fp32"] = compute_row("resnet50", "fp32", True, 1.3)
    line = goal(summarize(raw, out, parts), "compute: every ratio")
    assert line.startswith("MISS") and "1 of 12 miss" in line and "1.30" in line, line


def test_a_row_of_another_batch_is_not_the_goals_row(tmp_path):
    raw, out, parts = gpu_run(tmp_path)
    parts["compute"]["compute-gk-cnn-bf16"]["batch_size"] = 32
    line = goal(summarize(raw, out, parts), "compute, graph on (gk)")
    assert line.startswith("n/a ") and "not the goal's: cnn bf16 gk (b32, the goal's b256)" in line


def test_tf32_rows_count_toward_no_goal_and_get_their_own_line(tmp_path):
    raw, out, parts = gpu_run(tmp_path)
    tf32 = {**compute_row("cnn", "fp32", True, ratio=1.6, tf32=True), "step_graph": "off: x"}
    parts["compute"]["compute-gk-tf32-cnn-fp32"] = tf32
    parts["phases"]["compute-gk-tf32-cnn-fp32"] = "0 10"
    lines = summarize(raw, out, parts)
    assert goal(lines, "compute: every ratio").startswith("met ")
    assert goal(lines, "compute, graph on (gk)").startswith("met ")
    assert "tf32" not in goal(lines, "compute: every ratio")
    assert goal(lines, "compute --tf32").startswith("info") and "cnn fp32 gk tf32 1.60" in goal(
        lines, "compute --tf32"
    )
    assert lines[-1].startswith("met  every goal answered")


def test_correctness_is_judged_from_the_tests_it_names_not_from_an_optional_phase(tmp_path):
    """Only the optional kernels' phase skipped: the float64 checks (plain and with the kernels)
    and graph = plain passed in tests.xml, so both correctness goals are met."""
    raw, out, parts = gpu_run(tmp_path)
    parts["phases"]["tests-gpu-kernels"] = "skipped 0"
    lines = summarize(raw, out, parts)
    float64 = goal(lines, "correctness: float64")
    assert float64.startswith("met ") and "4 of 4 cases passed" in float64
    assert goal(lines, "correctness: graph and plain").startswith("met ")


def test_a_failed_correctness_test_is_a_miss_named_and_one_that_did_not_run_is_n_a(tmp_path):
    raw, out, parts = gpu_run(tmp_path)
    parts["tests"][2] = (FLOAT64_GK, "cnn", "failed")
    parts["tests"][4] = (GRAPH, "cnn-sgd", "skipped")
    parts["phases"]["tests"] = "1 80"
    lines = summarize(raw, out, parts)
    float64 = goal(lines, "correctness: float64")
    assert float64.startswith("MISS")
    assert "failed: test_gpu_float64_kernels.py::" + FLOAT64_GK[1] + "[cnn]" in float64
    graph = goal(lines, "correctness: graph and plain")
    assert graph.startswith("n/a ") and f"skipped: test_step_graph.py::{GRAPH[1]}[cnn-sgd]" in graph
    assert "needs CuPy and a GPU" in graph
    assert goal(lines, "no phase failed").startswith("MISS")
    parts["tests"] = [case for case in passing_tests() if case[0] != FLOAT64_GK]
    parts["phases"]["tests"] = "0 80"
    missing = goal(summarize(raw, out, parts), "correctness: float64")
    assert missing.startswith("n/a ") and f"not run: test_gpu_float64_kernels.py::{FLOAT64_GK[1]}"
    assert f"not run: test_gpu_float64_kernels.py::{FLOAT64_GK[1]}" in missing


def test_without_a_junit_xml_correctness_is_not_met(tmp_path):
    raw, out, parts = gpu_run(tmp_path)
    parts["tests"] = None
    line = goal(summarize(raw, out, parts), "correctness: float64")
    assert line.startswith("n/a ") and "no JUnit XML (raw/tests*.xml)" in line
    parts["phases"]["tests"] = "124 130"  # timed out: pytest wrote no XML
    line = goal(summarize(raw, out, parts), "correctness: float64")
    assert line.startswith("MISS") and "tests exit 124 left no JUnit XML" in line


def test_end_to_end_pairs_the_rows_with_the_same_workers_and_batch(tmp_path):
    """hpcdl.train (2 workers) against DataLoader at 2 workers, not the best over 8 and 15;
    without a 2-worker row, against the DataLoader row with the fewest more workers (8), named;
    never against another batch."""
    raw, out, parts = gpu_run(tmp_path)
    parts["input"] = [
        r for r in parts["input"] if not (r["loader"] == "dataloader" and r["workers"] == 15)
    ]
    parts["input"].append(input_row("dataloader", "cpu", 15, 2600.0, 0.04))
    line = goal(summarize(raw, out, parts), "end to end")
    assert line.startswith("met ") and "1.39" in line  # 1950 / 1402, not / 2600 (0.75)
    assert "2 workers b128: hpcdl.train 1950 vs DataLoader 1402 images/s" in line
    parts["input"] = [
        r for r in parts["input"] if not (r["loader"] == "dataloader" and r["workers"] == 2)
    ]
    line = goal(summarize(raw, out, parts), "end to end")
    eight = max(r["images_per_s"] for r in parts["input"]
                if r["loader"] == "dataloader" and r["workers"] == 8)  # fmt: skip
    assert f"2 workers b128: hpcdl.train 1950 vs DataLoader at 8 workers {eight:.0f}" in line
    assert line.startswith("met " if 1950 >= eight else "MISS"), line
    parts["input"] = [r for r in parts["input"] if r["loader"] != "dataloader"]
    parts["input"].append(input_row("dataloader", "cpu", 8, 1000.0, batch=256))  # another batch
    line = goal(summarize(raw, out, parts), "end to end")
    assert line.startswith("n/a ") and "no DataLoader row at 2 or more workers b128" in line


def test_the_cpu_dry_run_judges_no_goal_and_not_whether_every_goal_was_answered(tmp_path):
    raw, out, parts = gpu_run(tmp_path)
    for row in [*parts["compute"].values(), *parts["input"]]:
        row["device"] = "cpu"
    lines = summarize(raw, out, parts)
    assert [line for line in lines if line.startswith(("met ", "MISS"))] == [
        goal(lines, "no phase failed")
    ]
    assert lines[-1].startswith("n/a  every goal answered in this call")


def test_a_run_or_profile_skipped_for_time_leaves_its_goal_n_a_and_named_last(tmp_path):
    raw, out, parts = gpu_run(tmp_path)
    (raw / "train-cnn-gpu-1.jsonl").unlink()
    (raw / "profile-gk-cnn-fp32.log").unlink()
    parts["phases"]["train-cnn-gpu-1"] = parts["phases"]["profile-gk-cnn-fp32"] = "skipped 0"
    del parts["phases"]["train-tv-resnet50-gpu"]
    (raw / "train-tv-resnet50-gpu.jsonl").unlink()
    lines = summarize(raw, out, parts)
    seeded = goal(lines, "seeded run")
    assert seeded.startswith("n/a ") and "train-cnn-gpu-1 skipped for time" in seeded
    timing = goal(lines, "cnn slowdown with graphs")
    assert timing.startswith("n/a ") and "profile-gk-cnn-fp32 skipped for time" in timing
    engine = goal(lines, "61: train")
    assert engine.startswith("n/a ") and "no row (train-tv-resnet50-gpu not run)" in engine
    assert lines[-1].startswith("MISS every goal answered in this call  ")
    lacking = "3 lack a row or test: 61: train --model torchvision:rn50 bf16 >= 1.0x DataLoader; "
    assert lacking + "seeded run: val acc" in lines[-1]
    parts["phases"]["train-cnn-gpu-1"] = "1 9"  # it ran and failed: no figure, and a MISS
    assert goal(summarize(raw, out, parts), "seeded run").startswith("MISS")


def test_the_call_runs_in_its_goal_window_every_test_the_summary_judges_by():
    """scripts/gpu-check.sh's tests-goals phase selects (-k, files) each test that
    gpu_check_goals judges correctness by: one left out would run only in the tail, which the
    deadline cuts, and the goal would read n/a on every GPU run."""
    import importlib.util  # noqa: PLC0415 (scripts/ is not a package)

    spec = importlib.util.spec_from_file_location("goals", REPO / "scripts" / "gpu_check_goals.py")
    goals = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(goals)
    script = (REPO / "scripts" / "gpu-check.sh").read_text()
    block = script[script.index("GOAL_TESTS=(") : script.index("GOAL_K=")]
    for name in (*goals.FLOAT64_TESTS, *goals.GRAPH_TESTS):
        path, function = name.split("::")
        assert function in block.split("GOAL_FILES")[0], function
        assert path in block, path
        text = (REPO / path).read_text()
        assert "@pytest.mark.gpu" in text or "pytestmark = [pytest.mark.gpu" in text, path


def test_the_seeded_goal_judges_the_seeded_cnn_run_alone(tmp_path):
    """resnet18's GPU and CPU runs differ by 22.5 points in a recorded H200 run (its training
    path, not a backend fault): shown, never the seeded goal's figure."""
    raw, out, parts = gpu_run(tmp_path)
    for run, acc in (("resnet18-gpu-1", 0.70), ("ref-resnet18-cpu-1", 0.925)):
        summary = {"event": "summary", "val_accuracy": acc, "images_per_s": 900.0}
        (raw / f"train-{run}.jsonl").write_text(json.dumps(summary) + "\n")
        parts["phases"][f"train-{run}"] = "0 20"
    line = goal(summarize(raw, out, parts), "seeded run")
    assert line.startswith("met "), line
    assert "resnet18-gpu-1 vs ref-resnet18-cpu-1: 22.5 points (not judged)" in line, line


def test_a_case_two_pytest_phases_ran_counts_once(tmp_path):
    """tests-goals runs the goal tests, and `tests` (-m gpu tests) runs them again: each case
    counts once, failed where either run failed, passed where one passed and the other was
    skipped."""
    raw, out, parts = gpu_run(tmp_path)
    again = [(test, params, "skipped" if test == FLOAT64 else outcome)
             for test, params, outcome in parts["tests"]]  # fmt: skip
    (raw / "tests-goals.xml").write_text(junit(again))
    lines = summarize(raw, out, parts)
    assert "4 of 4 cases passed" in goal(lines, "correctness: float64")
    again[2] = (FLOAT64_GK, "cnn", "failed")
    (raw / "tests-goals.xml").write_text(junit(again))
    float64 = goal(summarize(raw, out, parts), "correctness: float64")
    assert float64.startswith("MISS") and "of 4 cases" in float64, float64


def test_autotuned_rows_count_toward_no_goal_and_get_their_own_line(tmp_path):
    """HPCDL_CUDNN_AUTOTUNE rows (engines timed in both frameworks, NOTE [engine autotuning]):
    a line of their own with hpcdl's per-step saving over the heuristics' engines; the goal
    rows stay the untuned ones."""
    raw, out, parts = gpu_run(tmp_path)
    plans = {"plans": 159, "engines": {"eng0": 100}, "timed": 106, "changed": 40,
             "first_ms": 21.5, "chosen_ms": 17.25}  # fmt: skip
    tuned = {**compute_row("resnet50", "bf16", True, ratio=1.3), "cudnn_autotune": 8,
             "cudnn_plans": plans}  # fmt: skip
    parts["compute"]["compute-gk-tuned-resnet50-bf16"] = tuned
    parts["phases"]["compute-gk-tuned-resnet50-bf16"] = "0 30"
    half = {**compute_row("resnet50", "bf16", True, ratio=1.4), "half_wgrad": True}
    parts["compute"]["compute-gk-halfwgrad-resnet50-bf16"] = half
    parts["phases"]["compute-gk-halfwgrad-resnet50-bf16"] = "0 30"
    parts["phases"]["compute-gk-tuned-cnn-fp32"] = "skipped 0"
    lines = summarize(raw, out, parts)
    assert goal(lines, "compute: every ratio").startswith("met ")
    assert "tuned" not in goal(lines, "compute: every ratio")
    line = goal(lines, "compute autotuned")
    assert line.startswith("info") and "resnet50 bf16 gk tuned 1.30" in line, line
    assert "40 of 106 timed plans changed, 21.50 -> 17.25 ms" in line, line
    assert "resnet50 bf16 gk halfwgrad 1.40" in line and "tuned-cnn-fp32 skipped" in line, line


def kernel_side(wall: float, kernels: list[tuple[str, str, float, float]]) -> dict:
    """One side of `bench compute --kernel-profile --json` (hpcdl/bench/kernel_profile.py)."""
    total = sum(ms for _, _, _, ms in kernels)
    groups: dict[str, float] = {}
    for _, group, _, ms in kernels:
        groups[group] = groups.get(group, 0.0) + ms
    return dict(device="cuda", wall_ms_per_step=wall, kernel_ms_per_step=total,
                kernels_per_step=sum(c for _, _, c, _ in kernels), busy=total / wall,
                kernels=[dict(name=n, group=g, calls_per_step=c, ms_per_step=ms,
                              share=ms / total) for n, g, c, ms in kernels],
                groups=groups, note=None)  # fmt: skip


def test_kernel_profiles_get_their_lines_and_their_file(tmp_path):
    """Each kprofile-* phase's last JSON line: both sides' figures, the groups side by side
    (the larger first) and the costliest kernels, and kprofile.jsonl for the record."""
    raw, out, parts = gpu_run(tmp_path)
    hpcdl = kernel_side(
        30.0,
        [
            ("sm90_xmma_wgrad_bf16", "convolution", 53, 12.5),
            ("cupy_copy__float32_bfloat16", "elementwise/copy", 106, 2.0),
        ],
    )
    torch = kernel_side(25.0, [("sm90_xmma_fprop_bf16", "convolution", 53, 9.0)])  # fmt: skip
    profile = {"kind": "kernel_profile", "model": "resnet50", "precision": "bf16",
               "hpcdl": hpcdl, "torch": torch}  # fmt: skip
    (raw / "kprofile-gk-resnet50-bf16.log").write_text("table\n" + json.dumps(profile) + "\n")
    (raw / "kprofile-gk-cnn-fp32.log").write_text("Traceback: x\n")
    lines = summary_text(raw, out, parts).splitlines()
    (head,) = [x for x in lines if x.startswith("  gk-resnet50-bf16 ") and "hpcdl wall" in x]
    assert "hpcdl wall 30.00, kernels 14.50 ms (159 per step, busy 0.48)" in head, head
    assert "torch wall 25.00, kernels 9.00 ms (53 per step" in head, head
    assert "    groups hpcdl/torch ms: convolution 12.50/9.00, elementwise/copy 2.00/0.00" in lines
    assert any(
        line.startswith("    top hpcdl: sm90_xmma_wgrad_bf16 12.50 ms x53") for line in lines
    )
    assert any("gk-cnn-fp32" in line and "no result" in line for line in lines)
    assert [json.loads(x)["model"] for x in (out / "kprofile.jsonl").read_text().splitlines()] == [
        "resnet50"
    ]
