"""Issue 60's goals, each judged beside its figure: the table that ends gpu_check_summary.py.

A goal names the rows and tests it needs, and is met only where all of them are there and meet
it. A row or test that failed (or a phase that failed and left nothing) makes it a MISS; one
skipped for time, never run, or of another shape (batch, input size) leaves it n/a, named. Each
such goal lacks a figure, and the last line, "every goal answered in this call", says which
(issue 60: the next lent device answers every goal in one call). A CPU dry run (every row's
device cpu) marks every goal but "no phase failed" n/a: its figures check the script.

The figures come from the files the summary wrote (compute.jsonl, input.jsonl, train.jsonl),
raw/phases.txt, the profiles, and the tests' JUnit XML (raw/tests*.xml, one per pytest phase).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import NamedTuple

# the goal's compute rows: model -> (batch, input side where the goal names one)
COMPUTE_ROWS = {"cnn": (256, None), "resnet20": (128, None), "resnet50": (64, 224)}
# rows gpu-check.sh runs after every goal's (no goal singles them out): their ratios count where
# they ran, their absence leaves no goal unanswered
AFTER_THE_GOALS = (("resnet50", "fp32", True),)
PRECISIONS = ("fp32", "bf16")
# the tests each correctness goal needs, as file::function (every parameter of it)
FLOAT64_TESTS = (
    "tests/test_gpu_path.py::test_a_model_computes_the_same_step_on_numpy_and_cupy",
    "tests/test_gpu_float64_kernels.py::test_the_float64_step_with_the_kernels_matches_numpy",
)
GRAPH_TESTS = (
    "tests/test_step_graph.py::test_graph_and_plain_steps_give_the_same_parameters_on_the_gpu",
    "tests/test_step_graph.py::"
    "test_two_plain_runs_on_deterministic_engines_give_the_same_bits_on_the_gpu",
    "tests/test_step_graph.py::"
    "test_segmented_graph_and_plain_steps_with_a_reducer_give_the_same_parameters",
)


class Goal(NamedTuple):
    """One line of the table: the goal, how it stands, and the figure (or what is missing)."""

    text: str
    mark: str  # "met ", "MISS", "n/a ", or "info" (a figure no goal waits on)
    figure: str
    lacking: bool = False  # a row or test it needs is not there: the goal is not answered


def junit_cases(raw: Path) -> dict:
    """The pytest phases' cases, from raw/tests*.xml: {"cases": {file::function: [(id, outcome,
    message)]}, "files": the phases that wrote one, "unreadable": those that did not parse};
    outcome: passed, failed (a failure or an error) or skipped."""
    cases: dict[str, list[tuple[str, str, str]]] = {}
    runs: dict[str, dict[str, list[tuple[str, str]]]] = {}  # key -> case -> its runs
    files, unreadable = [], []
    for path in sorted(raw.glob("tests*.xml")):
        try:
            root = ElementTree.parse(path).getroot()
        except ElementTree.ParseError:
            unreadable.append(path.stem)
            continue
        files.append(path.stem)
        for case in root.iter("testcase"):
            module = case.get("classname", "").replace(".", "/") + ".py"
            name = case.get("name", "")
            outcome, message = "passed", ""
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome, message = "failed", child.get("message", "")
                elif child.tag == "skipped" and outcome == "passed":
                    outcome, message = "skipped", child.get("message", "")
            key = f"{module}::{name.split('[')[0]}"
            runs.setdefault(key, {}).setdefault(name, []).append((outcome, message))
    # a case two phases ran (tests-goals, then `tests` with -m gpu) counts once: failed where
    # either run failed, else passed where one passed
    rank = {"failed": 0, "passed": 1, "skipped": 2}
    for key, names in runs.items():
        cases[key] = [(name, *min(each, key=lambda r: rank[r[0]])) for name, each in names.items()]
    return {"cases": cases, "files": files, "unreadable": unreadable}


def _state(status: dict, phase: str) -> str:
    """How a phase ended: "exit N", "skipped for time" or "not run"."""
    if phase not in status:
        return "not run"
    rc = status[phase][0]
    return "skipped for time" if rc == "skipped" else f"exit {rc}"


def _tuned(r: dict) -> bool:
    """A row with cuDNN's engines timed in both frameworks (HPCDL_CUDNN_AUTOTUNE), or with
    weight gradients in the format (HPCDL_HALF_WGRAD): an opt-in's row, no goal's."""
    return (r.get("cudnn_autotune") or 0) > 1 or bool(r.get("half_wgrad"))


def _row_name(r: dict) -> str:
    return (f"{r['model']} {r['precision']}" + (" gk" if r.get("gpu_kernels") else "")
            + (" tf32" if r.get("tf32") else "")
            + (" tuned" if (r.get("cudnn_autotune") or 0) > 1 else "")
            + (" halfwgrad" if r.get("half_wgrad") else ""))  # fmt: skip


def _tuned_figure(r: dict) -> str:
    """A tuned row's ratio and what timing changed in hpcdl's plans (cudnn_plans)."""
    figure = f"{_row_name(r)} {r['ratio']:.2f}" if r.get("ratio") else _row_name(r)
    plans = r.get("cudnn_plans") or {}
    if plans.get("timed"):
        figure += (f" ({plans['changed']} of {plans['timed']} timed plans changed, "
                   f"{plans['first_ms']:.2f} -> {plans['chosen_ms']:.2f} ms)")  # fmt: skip
    return figure


def _worst(pairs: list[tuple[float, str]], goal: float, above: bool = True) -> tuple[str, str]:
    """(mark, figure) for figures that must stay at or under goal (above=False: at or over)."""
    if not pairs:
        return "n/a ", "no figure"
    value, name = max(pairs) if above else min(pairs)
    missed = sum(1 for v, _ in pairs if (v > goal if above else v < goal))
    mark = "MISS" if missed else "met "
    return mark, f"worst {value:.2f} ({name}); {missed} of {len(pairs)} miss"


def _judged(text: str, pairs: list, goal: float, gaps: dict[str, list[str]],
            above: bool = True) -> Goal:  # fmt: skip
    """A goal over figures, with what it lacks (gaps: "failed", "skipped for time", ... ->
    names): MISS where a figure misses or something failed, n/a where only something is
    missing, met where nothing is."""
    mark, figure = _worst(pairs, goal, above)
    gaps = {why: names for why, names in gaps.items() if names}
    if gaps.get("failed"):
        mark = "MISS"
    elif gaps and mark == "met ":
        mark = "n/a "
    missing = "; ".join(f"{why}: {', '.join(names)}" for why, names in gaps.items())
    if missing:
        figure = f"{figure}; {missing}" if pairs else missing
    return Goal(text, mark, figure, bool(gaps) or not pairs)


def _goal_rows(rows: list[dict], status: dict, wanted: list[tuple[str, str, bool]]):
    """The goal's compute rows (model, precision, gk) found in rows, and what is missing, by
    why: the row's phase failed (or left no row), was skipped for time, did not run, or ran
    another batch or input size than the goal's."""
    found, gaps = [], {"failed": [], "skipped for time": [], "not run": [], "not the goal's": []}
    for model, precision, gk in wanted:
        batch, side = COMPUTE_ROWS[model]
        name = f"{model} {precision}" + (" gk" if gk else "")
        mine = [r for r in rows if (r["model"], r["precision"], bool(r.get("gpu_kernels")))
                == (model, precision, gk) and not r.get("tf32") and not _tuned(r)]  # fmt: skip
        right = [r for r in mine if r.get("batch_size", batch) == batch
                 and (side is None or r.get("input_shape", [side])[-1] == side)]  # fmt: skip
        if right:
            found.append(right[-1])
        elif mine:
            gaps["not the goal's"].append(f"{name} (b{mine[-1].get('batch_size')}, the goal's "
                                          f"b{batch}{f' at {side}' if side else ''})")  # fmt: skip
        else:
            state = _state(status, f"compute-{'gk-' if gk else ''}{model}-{precision}")
            why = state if state in ("skipped for time", "not run") else "failed"
            gaps[why].append(name if why != "failed" else f"{name} ({state})")
    return found, gaps


def compute_goals(rows: list[dict], status: dict) -> list[Goal]:
    """Every ratio (plain and gk) <= 1.0, the graph's on cnn and resnet20 <= 0.8, peak memory
    <= 1.2x torch's, each over the goal's rows only; the --tf32 rows on a line of their own."""
    everything = [(m, p, gk) for m in COMPUTE_ROWS for p in PRECISIONS for gk in (False, True)]
    found, gaps = _goal_rows(rows, status, [w for w in everything if w not in AFTER_THE_GOALS])
    found += _goal_rows(rows, status, list(AFTER_THE_GOALS))[0]  # judged where it ran
    no_torch = [_row_name(r) for r in found if not r.get("ratio")]
    ratios = [(r["ratio"], _row_name(r)) for r in found if r.get("ratio")]
    memory = [(r["hpcdl_peak_mib"] / r["torch_peak_mib"], _row_name(r)) for r in found
              if r.get("hpcdl_peak_mib") and r.get("torch_peak_mib")]  # fmt: skip
    no_memory = [_row_name(r) for r in found if not (r.get("hpcdl_peak_mib")
                                                     and r.get("torch_peak_mib"))]  # fmt: skip
    graph_rows, graph_gaps = _goal_rows(
        rows, status, [(m, p, True) for m in ("cnn", "resnet20") for p in PRECISIONS]
    )
    graph = [(r["ratio"], _row_name(r)) for r in graph_rows if r.get("ratio")]
    off = [f"{_row_name(r)}: {r.get('step_graph')}" for r in graph_rows
           if r.get("step_graph") != "captured"]  # fmt: skip
    graph_gaps["no torch figure"] = [_row_name(r) for r in graph_rows if not r.get("ratio")]
    graph_goal = _judged("compute, graph on (gk): cnn, resnet20 <= 0.8", graph, 0.8, graph_gaps)
    if off:  # a row whose steps ran plainly does not measure the graph
        graph_goal = graph_goal._replace(
            mark="MISS",
            figure=f"{graph_goal.figure}; graph not on in {len(off)} ({'; '.join(off)})",
        )
    goals = [
        _judged("compute: every ratio hpcdl/torch <= 1.0", ratios, 1.0,
                {**gaps, "no torch figure": no_torch}),
        graph_goal,
        _judged("compute: peak memory <= 1.2x torch's", memory, 1.2,
                {**gaps, "no memory figure": no_memory}),
    ]  # fmt: skip
    tf32 = [f"{_row_name(r)} {r['ratio']:.2f}" for r in rows if r.get("tf32") and r.get("ratio")]
    if tf32 or any(k.startswith("compute-gk-tf32-") for k in status):
        tf32_states = [f"{k.removeprefix('compute-gk-tf32-').replace('-', ' ')} gk tf32 "
                       f"{_state(status, k)}" for k in status
                       if k.startswith("compute-gk-tf32-") and status[k][0] != "0"]  # fmt: skip
        goals.append(Goal("compute --tf32 (no goal: what TF32 buys), ratio", "info",
                          ", ".join(tf32 + tf32_states) or "no row"))  # fmt: skip
    tuned = [_tuned_figure(r) for r in rows if _tuned(r)]
    opt_ins = ("compute-gk-tuned-", "compute-gk-halfwgrad-")
    tuned_states = [f"{k.removeprefix('compute-gk-')} {_state(status, k)}" for k in status
                    if k.startswith(opt_ins) and status[k][0] != "0"]  # fmt: skip
    if tuned or tuned_states:
        goals.append(Goal("compute autotuned / half weight gradients (opt-ins, no goal), ratio",
                          "info", "; ".join(tuned + tuned_states)))  # fmt: skip
    return goals


def end_to_end_goal(rows: list[dict], status: dict) -> Goal:
    """hpcdl.train with hpcdl's model against torchvision's step fed by DataLoader with the same
    batch and the same workers (the better DataLoader row of those: its prefetch depths), each
    pair named. The call runs hpcdl.train with --decode gpu and 2 workers, DataLoader with 8 and
    15: where no DataLoader row has hpcdl.train's workers, the one with the fewest more is its
    pair (DataLoader fed by more workers: a met holds with the same workers too; the pair
    says so), so the call answers the goal without a slow 2-worker DataLoader row."""
    text = "end to end: hpcdl.train rn50 bf16 >= 1.0x torch+DataLoader"
    train = [
        r for r in rows if r["loader"] == "hpcdl.train" and str(r["model"]).startswith("hpcdl ")
    ]
    if not train:
        state = _state(status, "input")
        return _judged(text, [], 1.0, {"failed" if state.startswith("exit") else state:
                                       [f"the hpcdl.train row (input {state})"]})  # fmt: skip
    pairs, unpaired = [], []
    for ours in train:
        batch = f" b{ours['batch']}" if ours.get("batch") else ""
        workers = ours["workers"] or 0
        fed = [r for r in rows if r["loader"] == "dataloader" and (r["workers"] or 0) >= workers
               and r.get("batch", ours.get("batch")) == ours.get("batch")]  # fmt: skip
        if not fed:
            ran = sorted({r["workers"] or 0 for r in rows if r["loader"] == "dataloader"})
            unpaired.append(f"no DataLoader row at {workers} or more workers{batch} (DataLoader "
                            f"at {', '.join(map(str, ran)) or 'no'} workers)")  # fmt: skip
            continue
        fewest = min(r["workers"] or 0 for r in fed)
        theirs = max((r for r in fed if (r["workers"] or 0) == fewest),
                     key=lambda r: r["images_per_s"])  # fmt: skip
        more = f" at {fewest} workers" if fewest != workers else ""
        gk = " --gpu-kernels" if str(ours["model"]).endswith("--gpu-kernels") else ""
        pairs.append((ours["images_per_s"] / theirs["images_per_s"],
                      f"{workers} workers{batch}: hpcdl.train{gk} {ours['images_per_s']:.0f} "
                      f"vs DataLoader{more} {theirs['images_per_s']:.0f} images/s"))  # fmt: skip
    return _judged(text, pairs, 1.0, {"unpaired": unpaired}, above=False)


def _tests_goal(text: str, wanted: tuple[str, ...], junit: dict, status: dict) -> Goal:
    """met where every case of every wanted test passed in some pytest phase's JUnit XML; MISS
    where one failed (or a pytest phase failed and left no XML); n/a naming those that were
    skipped or are in no XML."""
    cases, files = junit.get("cases", {}), junit.get("files", [])
    silent = [f"{k} {_state(status, k)} left no JUnit XML" for k in status
              if k.startswith("tests") and status[k][0] not in ("0", "skipped")
              and k not in files]  # fmt: skip
    if not files:
        unreadable = "".join(f", {k} unreadable" for k in junit.get("unreadable", []))
        gaps = {"failed": silent, "not run": [f"no JUnit XML (raw/tests*.xml){unreadable}"]}
        return _judged(text, [], 0.0, gaps)
    found = [(name, outcome, message, test.split("/")[-1].split("::")[0])
             for test in wanted for name, outcome, message in cases.get(test, [])]  # fmt: skip
    failed = [f"{file}::{name}" for name, outcome, _, file in found if outcome == "failed"]
    skipped = [f"{file}::{name} ({message})" for name, outcome, message, file in found
               if outcome == "skipped"]  # fmt: skip
    absent = [test.split("/")[-1] for test in wanted if test not in cases]
    passed = sum(1 for _, outcome, _, _ in found if outcome == "passed")
    figure = f"{passed} of {len(found)} cases passed"
    gaps = {"failed": failed + silent, "skipped": skipped, "not run": absent}
    mark = "MISS" if gaps["failed"] else ("n/a " if skipped or absent else "met ")
    figure += "".join(f"; {why}: {', '.join(names)}" for why, names in gaps.items() if names)
    return Goal(text, mark, figure, mark != "met ")


def _seeded_goal(facts: dict) -> Goal:
    """The seeded cnn run on the device (cnn-gpu-1) within 1 point of the CPU run's val acc
    (ref-cnn-cpu-1). Other device/CPU pairs (resnet18's) are shown, not judged: their gap is
    their training path's drift (22.5 points in a recorded H200 run), not what the goal asks."""
    status, train = facts["status"], {r["run"]: r.get("val_accuracy") for r in facts["train"]}
    gaps, others = [], []
    for run, acc in train.items():
        base = train.get("ref-" + re.sub(r"-(gpu|cpu)-", "-cpu-", run))
        if not run.startswith("ref-") and acc is not None and base is not None:
            pair = (abs(acc - base) * 100, run)
            (gaps if re.fullmatch(r"cnn-(gpu|cpu)-1", run) else others).append(pair)
    text = "seeded run: val acc within 1 point of the CPU run's"
    shown = "; ".join(f"{run} vs ref-{re.sub(r'-(gpu|cpu)-', '-cpu-', run)}: {gap:.1f} points "
                      "(not judged)" for gap, run in others)  # fmt: skip
    if gaps:
        judged = _judged(text, gaps, 1.0, {})
    else:
        device = [k for k in status if re.fullmatch(r"train-cnn-(gpu|cpu)-1", k)]
        pair = [*(device or ["train-cnn-gpu-1"]), "train-ref-cnn-cpu-1"]
        states = {k: _state(status, k) for k in pair if train.get(k.removeprefix("train-")) is None}
        why = "failed" if any(s.startswith("exit") for s in states.values()) else "not run"
        judged = _judged(text, gaps, 1.0, {why: [f"{k} {s}" for k, s in states.items()]})
    return judged._replace(figure=f"{judged.figure}; {shown}") if shown else judged


def _timing_goal(facts: dict) -> Goal:
    """cnn's per-op device time with --gpu-kernels (profile-gk-cnn-fp32): why graphs slowed it."""
    text = "cnn slowdown with graphs: per-op device time"
    gk = facts["profiles"].get("gk-cnn-fp32", {}).get("profile", {}).get("hpcdl")
    if gk is None:
        state = _state(facts["status"], "profile-gk-cnn-fp32")
        return Goal(text, "MISS" if state.startswith("exit") else "n/a ",
                    f"not recorded (profile-gk-cnn-fp32 {state})", True)  # fmt: skip
    device = gk.get("layers_gpu_ms")
    figure = f"gk cnn layers {_ms(gk['layers_ms'])} ms wall, {_ms(device)} device"
    return Goal(text, "n/a " if device is None else "met ", figure, device is None)


def _other_goals(facts: dict) -> list[Goal]:
    status, junit = facts["status"], facts.get("junit", {})
    failed = sorted(k for k, (rc, _) in status.items() if rc not in ("0", "skipped"))
    return [
        _tests_goal("correctness: float64 NumPy = CuPy <= 1e-9, plain and gk",
                    FLOAT64_TESTS, junit, status),
        _tests_goal("correctness: graph and plain steps give the same parameters",
                    GRAPH_TESTS, junit, status),
        _seeded_goal(facts),
        _timing_goal(facts),
        Goal("no phase failed", "MISS" if failed else "met ", ", ".join(failed) or "all exit 0"),
    ]  # fmt: skip


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def answered_goal(goals: list[Goal]) -> Goal:
    """The last line: met where no goal lacks a row or test it needs, else those goals."""
    text = "every goal answered in this call"
    lacking = [g.text for g in goals if g.lacking]
    if lacking:
        return Goal(text, "MISS", f"{len(lacking)} lack a row or test: {'; '.join(lacking)}", True)
    return Goal(text, "met ", f"all {sum(g.mark != 'info' for g in goals)} have their figures")


def _mark(ok: bool) -> str:
    return "met " if ok else "MISS"


def _no_row(text: str, status: dict, phase: str) -> Goal:
    """A goal whose row is not there: MISS where the phase that writes it failed, else n/a."""
    state = _state(status, phase)
    return Goal(text, "MISS" if state.startswith("exit") else "n/a ", f"no row ({phase} {state})",
                True)  # fmt: skip


def input_goals(rows: list[dict], status: dict, timing: dict | None = None) -> list[Goal]:
    """Issue 60's input goals, one line per worker count and per loader: default slots against
    the better DataLoader row at the same workers; their data wait, judged only where that
    DataLoader waits <= 5 % itself (n/a, with both figures, where it does not); --decode gpu
    with <= 2 workers against the same model's step alone (hpcdl.torch: torchvision's step;
    hpcdl.train: hpcdl's own)."""
    loaders = [r for r in rows if r["loader"] == "dataloader"]
    best = {w: max((r for r in loaders if r["workers"] == w), key=lambda r: r["images_per_s"])
            for w in {r["workers"] for r in loaders}}  # fmt: skip
    own = {r["workers"]: r for r in rows if (r["loader"], r["decode"]) == ("hpcdl", "cpu")}
    out = []
    dry = rows and all(r.get("device") == "cpu" for r in rows)  # a CPU dry run: its own counts
    for workers in sorted(set(best) | set(own)) if dry else (8, 15):
        mine, theirs = own.get(workers), best.get(workers)
        goal = f"input: default slots >= 1.0x DataLoader, {workers} workers"
        if mine is None or theirs is None:
            out.append(_no_row(goal, status, "input"))
            continue
        ratio = mine["images_per_s"] / theirs["images_per_s"]
        out.append(Goal(goal, _mark(ratio >= 1.0), f"{ratio:.2f} ({mine['images_per_s']:.0f} vs "
                        f"{theirs['images_per_s']:.0f} images/s)"))  # fmt: skip
        wait, dl_wait = 100 * mine["data_wait_share"], 100 * theirs["data_wait_share"]
        figure = f"{wait:.1f} %, DataLoader {dl_wait:.1f} %"
        mark = _mark(wait <= 5.0) if dl_wait <= 5.0 else "n/a "  # not judged: still answered
        out.append(Goal(f"input: data wait <= 5 % where DataLoader's is, {workers} workers", mark,
                        figure + ("" if dl_wait <= 5.0 else " (> 5 %: not judged)")))  # fmt: skip
    return [end_to_end_goal(rows, status), *out, *_decode_goals(rows, status, timing or {})]


def _decode_goals(rows: list[dict], status: dict, timing: dict) -> list[Goal]:
    """--decode gpu with <= 2 workers against the same model's step alone: hpcdl.torch
    (torchvision's step), hpcdl.train with hpcdl's own model ("hpcdl resnet50") and, where the
    torch engine's row is there, with torchvision's (issue 61), one line each. The torch
    engine's line says how each side was timed: timing["decode"], the steps its run's records
    time (gpu_check_train_rows.py's window), and timing["input"], `bench input`'s (warm-up,
    timed steps) for its step alone."""
    alone = {r.get("model"): r["images_per_s"] for r in rows if r["loader"] == "none"}
    out = []
    for loader, own in (("hpcdl", None), ("hpcdl.train", True), ("hpcdl.train", False)):
        fed = [r for r in rows if (r["loader"], r["decode"]) == (loader, "gpu")
               and (r["workers"] or 0) <= 2 and alone.get(r.get("model"))
               and (own is None or str(r.get("model")).startswith("hpcdl ") == own)]  # fmt: skip
        which = "" if own is None else (", hpcdl's model" if own else ", a torch model")
        goal = f"input: --decode gpu in {loader}{which} >= 0.95x the step alone"
        if not fed:
            if own is not False:  # the torch engine's row is new: no line where it is not there
                out.append(_no_row(goal, status, "input"))
            continue
        r = max(fed, key=lambda r: r["images_per_s"])
        step = alone[r.get("model")]
        ratio = r["images_per_s"] / step
        figure = (
            f"{ratio:.2f} ({r['images_per_s']:.0f} vs {step:.0f} images/s, {r['workers']} workers)"
        )
        window, steps = timing.get("decode"), timing.get("input")
        if own is False and window and steps:
            figure += (f"; hpcdl.train over steps {window[0]}-{window[1]} (its step records) vs "
                       f"the step alone over steps {steps[0] + 1}-{sum(steps)}")  # fmt: skip
        out.append(Goal(goal, _mark(ratio >= 0.95), figure))
    return out


def _torch_engine_goal(facts: dict) -> Goal:
    """Issue 61: hpcdl.train --model torchvision:resnet50 against DataLoader with the run's
    workers and batch (the better of its prefetch depths), both timed over steps after a
    warm-up: the run from its step records (steps_images_per_s: the steps after the first 6),
    DataLoader as `bench input` times it (the input phase's --warmup and --steps). Not by the
    run summary's rate, which holds start-up, the warm-up steps and cuDNN's autotuning (and
    any checkpoint or evaluation). The line says how each side was timed and what still
    differs: hpcdl.train's loss read (each --metrics-every steps) and its epoch end."""
    text = "61: train --model torchvision:rn50 bf16 >= 1.0x DataLoader"
    status = facts["status"]
    phase = next((k for k in status if k.startswith("train-tv-resnet50-")),
                 "train-tv-resnet50-gpu")  # fmt: skip
    run = next((r for r in facts["train"] if r["run"].startswith("tv-resnet50-")
                and r.get("images_per_s")), None)  # fmt: skip
    if run is None:
        return _no_row(text, status, phase)
    if not run.get("steps_images_per_s"):
        return Goal(text, "n/a ", f"no step records after step {run.get('warmup_steps')} in "
                    f"raw/train-{run['run']}.jsonl (its summary's {run['images_per_s']:.0f} "
                    "images/s holds its start-up and warm-up: not judged)", True)  # fmt: skip
    workers, batch = run.get("workers"), run.get("batch_size")
    fed = [r for r in facts["input"] if r["loader"] == "dataloader" and r["workers"] == workers
           and r.get("batch") == batch]  # fmt: skip
    if not fed:
        state = _state(status, "input")
        failed = state.startswith("exit") and state != "exit 0"
        why = f"no DataLoader row at {workers} workers b{batch} (input {state})"
        return Goal(text, "MISS" if failed else "n/a ", why, True)
    theirs = max(fed, key=lambda r: r["images_per_s"])
    ours, (first, last) = run["steps_images_per_s"], run["steps_timed"]
    ratio = ours / theirs["images_per_s"]
    warmup, steps = facts.get("input_timing") or (None, None)
    dl_steps = f"steps {warmup + 1}-{warmup + steps}" if warmup is not None else "its steps"
    slots = f" (slots {theirs['slots']})" if theirs.get("slots") else ""
    every = run.get("metrics_every")
    read = "each step" if every == 1 else f"every {every} steps" if every else "per its records"
    per_epoch = run.get("steps_per_epoch")
    ends = [k for k in range(first, last) if per_epoch and k % per_epoch == 0]
    plural = "s" if len(ends) > 1 else ""
    among = f", its epoch end{plural} (step{plural} {', '.join(map(str, ends))}) among them"
    among = among if ends else ""
    figure = (f"{ratio:.2f}: hpcdl.train {ours:.0f} images/s over steps {first}-{last} vs "
              f"DataLoader {theirs['images_per_s']:.0f} images/s over {dl_steps}{slots}, "
              f"{workers} workers b{batch}; hpcdl.train's window holds its loss read {read}"
              f"{among}, DataLoader's loop neither")  # fmt: skip
    return Goal(text, _mark(ratio >= 1.0), figure)


def goal_lines(facts: dict) -> list[str]:
    """Issue 60's goals, one line each: met / MISS / n/a, the goal, its figure; "every goal
    answered in this call" last. A CPU dry run (every row's device cpu) marks every goal but
    "no phase failed" n/a: its figures check the script, not the goals."""
    status = facts["status"]
    goals = compute_goals(facts["compute"], status)
    decode = [r.get("steps_timed") for r in facts["train"] if r["run"].startswith("tv-decode-")]
    timing = {"input": facts.get("input_timing"), "decode": decode[0] if decode else None}
    goals += input_goals(facts["input"], status, timing)
    goals += [_torch_engine_goal(facts), *_other_goals(facts)]
    goals.append(answered_goal(goals))
    head = "goals (issue 60)"
    devices = {r.get("device") for r in facts["compute"] + facts["input"]}
    if devices == {"cpu"}:
        head += ": a CPU dry run, so the figures check the script, not the goals"
        goals = [g if g.text == "no phase failed" or g.mark == "info" else g._replace(mark="n/a ")
                 for g in goals]  # fmt: skip
    return [head] + [f"  {g.mark} {g.text:<60} {g.figure}" for g in goals]
