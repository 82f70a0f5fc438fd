"""The table that ends scripts/gpu-check.sh, from its raw/ folder; also writes the top-level
tests.log, compute.jsonl, profile.jsonl, kprofile.jsonl, train.jsonl and loader.json beside it.
It ends with
issue 60's goals, each beside its figure (gpu_check_goals.goal_lines).

    python scripts/gpu_check_summary.py RAW_DIR OUT_DIR
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ is not a package
from gpu_check_goals import goal_lines, junit_cases  # noqa: E402
from gpu_check_train_rows import WARMUP_STEPS, steps_window  # noqa: E402


def last_json(path: Path) -> dict | None:
    """The last line of a log that parses as a JSON object, or None."""
    if not path.exists():
        return None
    for line in reversed(path.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def records(path: Path, event: str) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("event") == event:
            out.append(r)
    return out


def phases(raw: Path) -> dict[str, tuple[str, str]]:
    table = {}
    for line in (raw / "phases.txt").read_text().splitlines():
        name, rc, seconds = line.split()
        table[name] = (rc, seconds)
    return table


def tests_section(raw: Path, out: Path, status: dict) -> list[str]:
    lines, logs = ["tests"], []
    for name in ("tests", "tests-mpi"):
        log = raw / f"{name}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        logs.append(f"===== {name} (exit {status.get(name, ('-', ''))[0]})\n{text}")
        tail = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped)", ln)]
        result = tail[-1] if tail else "(no result)"
        lines.append(f"  {name:10s} exit {status.get(name, ('-',))[0]:>3s}  {result}")
    (out / "tests.log").write_text("\n".join(logs))
    return lines


def train_section(raw: Path, out: Path, status: dict) -> list[str]:
    lines = ["training (val acc: last epoch; fp16: loss-scale range, skipped steps)"]
    lines.append(f"  {'run':22s} {'exit':>4s} {'steps':>6s} {'val_acc':>8s} {'img/s':>9s}  fp16")
    summaries = []
    for path in sorted(raw.glob("train-*.jsonl")):
        name = path.stem.removeprefix("train-")
        rc = status.get(f"train-{name}", ("-",))[0]
        summary = (records(path, "summary") or [{}])[-1]
        summaries.append({"run": name, "exit": rc, **summary, **run_timing(path, summary)})
        scales = [r["loss_scale"] for r in records(path, "step") if "loss_scale" in r]
        fp16 = (
            f"scale {min(scales):g}..{max(scales):g}, skipped {summary.get('skipped_steps')}"
            if scales
            else ""
        )
        acc, rate = summary.get("val_accuracy"), summary.get("images_per_s")
        acc_text = "-" if acc is None else f"{acc:.4f}"
        rate_text = "-" if rate is None else f"{rate:.0f}"
        steps = summary.get("steps", "-")
        lines.append(f"  {name:22s} {rc:>4s} {steps!s:>6s} {acc_text:>8s} {rate_text:>9s}  {fp16}")
    (out / "train.jsonl").write_text("".join(json.dumps(s) + "\n" for s in summaries))
    acc = {s["run"]: s.get("val_accuracy") for s in summaries}
    for run, ref in sorted(acc.items()):
        base = "ref-" + re.sub(r"-(gpu|cpu)-", "-cpu-", run)
        if run.startswith("ref-") or acc.get(base) is None or ref is None:
            continue
        lines.append(f"  {run} vs {base}: {100 * (ref - acc[base]):+.1f} points of val acc")
    return lines


def run_timing(path: Path, summary: dict) -> dict:
    """A run's flags that its rate depends on (workers, batch_size, metrics_every, from its
    start record), steps_per_epoch, and its images/s over the steps after the warm-up from its
    step records (steps_images_per_s, steps_timed [first, last]; gpu_check_train_rows.py's
    window, as `bench input` times its rows), where there are such records."""
    start = (records(path, "start") or [{}])[-1]
    config = start.get("config") or {}
    config = json.loads(config) if isinstance(config, str) else config
    out = {k: config.get(k) for k in ("workers", "batch_size", "metrics_every")}
    out["steps_per_epoch"], out["warmup_steps"] = start.get("steps_per_epoch"), WARMUP_STEPS
    batch = summary.get("global_batch") or start.get("global_batch")
    window = steps_window(records(path, "step"), batch) if batch else None
    if window is not None:
        out["steps_images_per_s"], out["steps_timed"] = window[0], list(window[1:])
    return out


def compute_section(raw: Path, out: Path) -> tuple[list[str], dict]:
    lines = ["compute (ms/step; ratio hpcdl/torch; peak MiB hpcdl vs torch reserved)"]
    rows = []
    for path in sorted(raw.glob("compute-*.log")):
        row = last_json(path)
        name = path.stem.removeprefix("compute-")
        if row is None:
            lines.append(f"  {name:18s} (no result: see raw/{path.name})")
            continue
        rows.append(row)
        nan = float("nan")
        lines.append(
            f"  {name:18s} b{row['batch_size']:<4d} hpcdl {row['hpcdl_ms_per_step']:8.2f}  "
            f"torch {row['torch_ms_per_step'] or nan:8.2f}  ratio {row['ratio'] or nan:5.2f}  "
            f"MiB {row.get('hpcdl_peak_mib') or 0:7.0f} / {row.get('torch_peak_mib') or 0:7.0f}"
        )
    (out / "compute.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    by_name = {(r["model"], r["precision"]): r for r in rows if not r.get("tf32")
               and (r.get("cudnn_autotune") or 0) <= 1 and not r.get("half_wgrad")}  # fmt: skip
    return lines, by_name


def loader_section(raw: Path, out: Path, compute: dict) -> list[str]:
    result = last_json(raw / "loader.log")
    if result is None:
        return ["loader: no result (see raw/loader.log)"]
    (out / "loader.json").write_text(json.dumps(result) + "\n")
    rate = result["hpcdl_images_per_s"]
    lines = [f"loader: {result['augment']}, {result['workers']} workers: {rate:.0f} images/s"]
    step = compute.get(("resnet50", "bf16"))
    if step:
        for who in ("hpcdl", "torch"):
            need = step.get(f"{who}_images_per_s")
            if need:
                lines.append(
                    f"  vs the resnet50 bf16 step ({who}): {need:.0f} images/s, "
                    f"so decode covers {rate / need:.2f}x of it"
                )
    return lines


def input_lines(rows: list[dict]) -> list[str]:
    """Issue 48's rows (OUT/input.jsonl) and its goal ratios: hpcdl with default slots against
    the better DataLoader at each worker count, and GPU decode (hpcdl.torch.Loader's and
    hpcdl.train's) against the same model's step alone."""
    if not rows:
        return ["input: no rows (see input.log)"]
    lines = ["input (issue 48: images/s, data wait)"]
    for r in rows:
        what = f"{r['loader']} decode {r['decode']} workers {r['workers']} slots {r['slots']}"
        extra = ""
        if r.get("decode_images_per_s"):
            extra = f", {r['decoder']} alone {r['decode_images_per_s']:.0f}"
        lines.append(
            f"  {what:<44} {r['images_per_s']:8.0f}  {100 * r['data_wait_share']:5.1f} %{extra}"
        )
    alone = {r.get("model"): r["images_per_s"] for r in rows if r["loader"] == "none"}
    for workers in sorted({r["workers"] for r in rows if r["loader"] == "dataloader"}):
        best = max(r["images_per_s"] for r in rows
                   if r["loader"] == "dataloader" and r["workers"] == workers)  # fmt: skip
        for r in rows:
            if (r["loader"], r["decode"], r["workers"]) == ("hpcdl", "cpu", workers):
                ratio = r["images_per_s"] / best
                lines.append(f"  {workers} workers: hpcdl / best DataLoader {ratio:.2f} "
                             "(goal >= 1.0, wait <= 5 %)")  # fmt: skip
    for r in rows:
        step = alone.get(r.get("model"))
        if step and r["loader"] in ("hpcdl", "hpcdl.train") and r["decode"] == "gpu":
            lines.append(f"  {r['loader']} decode gpu, {r['workers']} workers: / the step alone "
                         f"{r['images_per_s'] / step:.2f} (goal >= 0.95)")  # fmt: skip
    return lines


def input_section(out: Path) -> list[str]:
    path = out / "input.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return input_lines(rows)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def profile_lines(name: str, result: dict) -> list[str]:
    """One profile run (`bench compute --profile --json`): the layers' wall and device time on
    each side, then where hpcdl's device time most exceeds PyTorch's and where its host time
    (wall minus device: launches, the cuDNN frontend's execute) is largest."""
    ours, theirs = result["profile"]["hpcdl"], result["profile"].get("torch")
    line = (f"  {name:18s} hpcdl layers {_ms(ours['layers_ms'])} ms, device "
            f"{_ms(ours.get('layers_gpu_ms'))}; step {_ms(ours['plain_step_ms'])}")  # fmt: skip
    if theirs:
        device, step = _ms(theirs.get("layers_gpu_ms")), _ms(theirs["plain_step_ms"])
        line += f" | torch layers {_ms(theirs['layers_ms'])}, device {device}; step {step}"
    lines = [line]

    def gpu(row: dict | None) -> float | None:
        if row is None or row.get("forward_gpu_ms") is None:
            return None
        return row["forward_gpu_ms"] + (row.get("backward_gpu_ms") or 0.0)

    host = sorted(((r["forward_ms"] + r["backward_ms"] - gpu(r), r["name"])
                   for r in ours["rows"] if gpu(r) is not None), reverse=True)  # fmt: skip
    if host:
        lines.append("    most host time: " + ", ".join(f"{n} {t:.2f}" for t, n in host[:3]))
    if theirs:
        pairs = list(zip(ours["rows"], _paired(ours["rows"], theirs["rows"]), strict=True))
        gaps = sorted(((gpu(a) - gpu(b), a["name"]) for a, b in pairs
                       if gpu(a) is not None and gpu(b) is not None), reverse=True)  # fmt: skip
        if gaps:
            lines.append("    most device time over torch: "
                         + ", ".join(f"{n} +{t:.2f}" for t, n in gaps[:3]))  # fmt: skip
    return lines


def _paired(ours: list[dict], theirs: list[dict]) -> list[dict | None]:
    """For each of our rows, torch's row of the same kind in forward order, or None."""
    out: list[dict | None] = []
    at = 0
    for row in ours:
        match = next((i for i in range(at, len(theirs)) if theirs[i]["kind"] == row["kind"]), None)
        out.append(None if match is None else theirs[match])
        at = at if match is None else match + 1
    return out


def profile_section(raw: Path, out: Path) -> tuple[list[str], dict]:
    lines = ["profile (ms per step; device = CUDA events around each layer)"]
    results = {}
    for path in sorted(raw.glob("profile-*.log")):
        name = path.stem.removeprefix("profile-")
        result = last_json(path)
        if result is None or "profile" not in result:
            lines.append(f"  {name:18s} (no result: see raw/{path.name})")
            continue
        results[name] = result
        lines += profile_lines(name, result)
    (out / "profile.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results.values()))
    return lines, results


def _kernel_side(side: dict | None) -> str:
    """One side of a kernel profile: wall and kernel ms per step, launches, busy share."""
    if not side:
        return "not run"
    if side.get("kernel_ms_per_step") is None:
        return f"wall {_ms(side.get('wall_ms_per_step'))} ms; {side.get('note') or 'no kernels'}"
    return (f"wall {_ms(side['wall_ms_per_step'])}, kernels {_ms(side['kernel_ms_per_step'])} ms"
            f" ({side['kernels_per_step']:g} per step, busy {side['busy'] or 0:.2f})")  # fmt: skip


def kernel_profile_lines(name: str, result: dict) -> list[str]:
    """One `bench compute --kernel-profile --json` run: each side's figures, the groups side by
    side (largest first), and each side's three costliest kernels."""
    ours, theirs = result.get("hpcdl"), result.get("torch")
    lines = [f"  {name:18s} hpcdl {_kernel_side(ours)} | torch {_kernel_side(theirs)}"]
    mine, other = (ours or {}).get("groups") or {}, (theirs or {}).get("groups") or {}
    groups = sorted(set(mine) | set(other), key=lambda g: -max(mine.get(g, 0), other.get(g, 0)))
    if groups:
        lines.append("    groups hpcdl/torch ms: " + ", ".join(
            f"{g} {mine.get(g, 0):.2f}/{other.get(g, 0):.2f}" for g in groups))  # fmt: skip
    for side, label in ((ours, "hpcdl"), (theirs, "torch")):
        top = (side or {}).get("kernels") or []
        if top:
            lines.append(f"    top {label}: " + "; ".join(
                f"{k['name'][:48]} {k['ms_per_step']:.2f} ms x{k['calls_per_step']:g}"
                for k in top[:3]))  # fmt: skip
    return lines


def kernel_profile_section(raw: Path, out: Path) -> list[str]:
    """The kernel profiles (raw/kprofile-*.log) into kprofile.jsonl and their summary lines."""
    paths = sorted(raw.glob("kprofile-*.log"))
    if not paths:
        return []
    lines = ["kernel profile (ms per step; kernels: device time of each CUDA kernel, CUPTI)"]
    results = []
    for path in paths:
        name = path.stem.removeprefix("kprofile-")
        result = last_json(path)
        if result is None or result.get("kind") != "kernel_profile":
            lines.append(f"  {name:18s} (no result: see raw/{path.name})")
            continue
        results.append(result)
        lines += kernel_profile_lines(name, result)
    (out / "kprofile.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    return lines


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{")]


def input_timing(path: Path) -> tuple[int, int] | None:
    """(warm-up, timed steps) of the input phase's DataLoader rows: the --warmup and --steps of
    its first `hpcdl.bench input` command (scripts/gpu-check-input.sh), or None."""
    text = path.read_text(errors="replace") if path.exists() else ""
    for line in text.splitlines():
        warmup, steps = re.search(r" --warmup (\d+)", line), re.search(r" --steps (\d+)", line)
        if "hpcdl.bench input" in line and warmup and steps:
            return int(warmup[1]), int(steps[1])
    return None


def load_facts(raw: Path, out: Path, status: dict, profiles: dict) -> dict:
    """What the goals are judged from: the files this summary wrote, the phases, the profiles
    and the pytest phases' JUnit XML."""
    return {
        "compute": _jsonl(out / "compute.jsonl"),
        "input": _jsonl(out / "input.jsonl"),
        "train": _jsonl(out / "train.jsonl"),
        "input_timing": input_timing(out / "input-commands.txt"),
        "status": status,
        "profiles": profiles,
        "junit": junit_cases(raw),
    }


def main() -> int:
    raw, out = Path(sys.argv[1]), Path(sys.argv[2])
    status = phases(raw)
    stager = raw / "stager.txt"
    lines = [
        "phases: " + ", ".join(f"{k} {rc} ({s} s)" for k, (rc, s) in status.items()),
        stager.read_text().strip() if stager.exists() else "stager: not recorded",
        *tests_section(raw, out, status),
        *train_section(raw, out, status),
    ]
    compute_lines, compute = compute_section(raw, out)
    profile_text, profiles = profile_section(raw, out)
    lines += compute_lines + kernel_profile_section(raw, out) + profile_text
    lines += loader_section(raw, out, compute) + input_section(out)
    lines += goal_lines(load_facts(raw, out, status, profiles))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
