"""Every round of the recorded 4-node peer-staging runs (rounds/*.json, listed in rounds/runs.txt)
pooled: per run and over all rounds, the later epochs of the global shuffle with peers over the
same round's --shuffle node job, and the cluster model's error on each (measured / model - 1).
The goals of issue 35: peers / node <= 1.2, |error| <= 15 %. Usage: pool_rounds.py [FILE...]"""

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def later(job_round: dict, key: str = "epochs_s") -> float:
    return float(np.mean(job_round[key][1:]))


def rounds_of(path: Path) -> list[tuple[float, float, float]]:
    """(peers / node, node's error, peers' error) of each round."""
    jobs = json.loads(path.read_text())["jobs"]
    out = []
    for node, peers in zip(jobs["node"]["rounds"], jobs["global, peers"]["rounds"]):
        out.append((later(peers) / later(node),
                    later(node) / later(node, "model_epochs_s") - 1,
                    later(peers) / later(peers, "model_epochs_s") - 1))  # fmt: skip
    return out


def line(name: str, rows: np.ndarray) -> str:
    ratio, node, peers = rows[:, 0], rows[:, 1], rows[:, 2]
    spread = f"{np.median(ratio):.2f} ({ratio.min():.2f}-{ratio.max():.2f})"
    return (f"| {name} | {len(rows)} | {spread} "
            f"| {100 * np.median(node):+.0f} % | {100 * np.median(peers):+.0f} % "
            f"| {np.mean(ratio <= 1.2):.0%} | {np.mean(abs(node) <= 0.15):.0%} "
            f"| {np.mean(abs(peers) <= 0.15):.0%} |")


def main() -> None:
    paths = [Path(p) for p in sys.argv[1:]] or sorted((HERE / "rounds").glob("*.json"))
    print("| run | rounds | peers / node, median (range) | node's error, median "
          "| peers' error, median | rounds <= 1.2x | node within 15 % | peers within 15 % |")
    print("|---|---|---|---|---|---|---|---|")
    pooled = []
    for path in paths:
        rows = rounds_of(path)
        pooled += rows
        print(line(path.stem, np.array(rows)))
    print(line("all rounds", np.array(pooled)))


if __name__ == "__main__":
    main()
