"""What the doctor found: facts per rank, problems as one line each with the fix, exit status."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

ERROR = "error"  # training cannot run as configured
WARNING = "warning"  # training runs, but slower or less safely than it should

EXIT_OK = 0
EXIT_WARNINGS = 1
EXIT_ERRORS = 2


@dataclass(frozen=True)
class Problem:
    level: str  # ERROR or WARNING
    message: str  # one line: what is wrong, then "; fix: ..."

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def exit_status(problems: list[Problem]) -> int:
    """2 when training cannot run, 1 when something should be fixed, else 0."""
    levels = {p.level for p in problems}
    if ERROR in levels:
        return EXIT_ERRORS
    return EXIT_WARNINGS if WARNING in levels else EXIT_OK


def rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out: list[str] = []
    for r in sorted(ranks):
        if out and r == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ",".join(out)


def merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One record per node from the ranks' reports (gathered on rank 0, in rank order).

    A fact all ranks of a node agree on is the node's; one they differ on is listed per rank.
    Problems with the same text from several ranks become one, naming the ranks."""
    nodes: dict[str, list[dict[str, Any]]] = {}
    for report in reports:
        nodes.setdefault(report["host"], []).append(report)
    merged_nodes = []
    for host, ranks in nodes.items():
        keys = list(ranks[0]["facts"])
        common = {
            k: ranks[0]["facts"][k]
            for k in keys
            if all(r["facts"][k] == ranks[0]["facts"][k] for r in ranks)
        }
        per_rank = {
            str(r["rank"]): {k: r["facts"][k] for k in keys if k not in common} for r in ranks
        }
        merged_nodes.append(
            {
                "host": host,
                "ranks": [r["rank"] for r in ranks],
                "facts": common,
                "per_rank": per_rank if any(per_rank.values()) else {},
            }
        )
    seen: dict[tuple[str, str], list[int]] = {}
    hosts: dict[tuple[str, str], set[str]] = {}
    for report in reports:
        for p in report["problems"]:
            key = (p["level"], p["message"])
            seen.setdefault(key, []).append(report["rank"])
            hosts.setdefault(key, set()).add(report["host"])
    problems = [
        {
            "level": level,
            "message": message,
            "ranks": ranks,
            "nodes": sorted(hosts[(level, message)]),
        }
        for (level, message), ranks in seen.items()
    ]
    problems.sort(key=lambda p: p["level"] != ERROR)
    status = exit_status([Problem(p["level"], p["message"]) for p in problems])
    return {
        "world_size": len(reports),
        "num_nodes": len(nodes),
        "nodes": merged_nodes,
        "problems": problems,
        "status": status,
    }
