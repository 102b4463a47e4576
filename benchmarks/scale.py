"""How rankguard's cross-rank checks grow with world size (gloo, CPU processes).

For world sizes 2, 4, 8, 16, 32 (simulated nodes of 4 ranks, one torchrun per
node, master on 127.0.0.1), times the fit-start checks of every guard and a
watchdog-status-sized exchange, on the deciding rank (0) and on the others,
with the bytes each sends and receives; fits ``t = a + b * world`` and projects
to 4096 ranks.

Usage: ``python benchmarks/scale.py [--sizes 2,4,8,16,32] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from launch import launch_nodes

HERE = Path(__file__).resolve().parent


def measure(world: int, repeats: int) -> dict:
    per_node = min(world, 4)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "scale.json"
        results = launch_nodes(
            HERE / "scale_worker.py",
            [str(out), "--repeats", str(repeats)],
            world // per_node,
            per_node,
            timeout=600,
        )
        if not out.exists():
            raise SystemExit(f"world {world} failed:\n{results[0].stderr[-3000:]}")
        return json.loads(out.read_text())


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return my - b * mx, b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,4,8,16,32")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    print(
        f"{'world':>5} | {'fit-start checks ms':^25} | {'status exchange ms':^25} | "
        f"{'bytes sent/recv per exchange':^40}"
    )
    print(
        f"{'':>5} | {'rank 0':>11} {'others max':>13} | {'rank 0':>11} {'others max':>13} | "
        f"{'rank 0':>19} {'other rank':>20}"
    )
    for world in sizes:
        ranks = measure(world, args.repeats)["ranks"]
        leader, others = ranks[0], ranks[1:]
        n_check = 2 * args.repeats  # two guards exchange at fit start
        row = {
            "world": world,
            "check0": 1000 * leader["check_s"],
            "check_o": 1000 * max(r["check_s"] for r in others),
            "status0": 1000 * leader["status_s"],
            "status_o": 1000 * max(r["status_s"] for r in others),
            "bytes0": [b / n_check for b in leader["check_bytes"]],
            "bytes_o": [b / n_check for b in others[-1]["check_bytes"]],
        }
        rows.append(row)
        print(
            f"{world:>5} | {row['check0']:>11.1f} {row['check_o']:>13.1f} | "
            f"{row['status0']:>11.1f} {row['status_o']:>13.1f} | "
            f"{row['bytes0'][0]:>8.0f} / {row['bytes0'][1]:>8.0f} "
            f"{row['bytes_o'][0]:>9.0f} / {row['bytes_o'][1]:>8.0f}"
        )
    worlds = [r["world"] for r in rows]
    print("\nfitted t = a + b * world (ms), projected to 4096 ranks:")
    for key, label in (
        ("check0", "fit-start checks, rank 0"),
        ("check_o", "fit-start checks, slowest other"),
        ("status0", "status exchange, rank 0"),
        ("status_o", "status exchange, slowest other"),
    ):
        a, b = fit(worlds, [r[key] for r in rows])
        print(f"  {label:<34} a={a:7.2f} b={b:7.3f}  -> {a + b * 4096:9.1f} ms at 4096")
    for key, label in (("bytes0", "bytes received by rank 0"), ("bytes_o", "by another rank")):
        a, b = fit(worlds, [r[key][1] for r in rows])
        projected = a + b * 4096
        print(f"  {label:<34} a={a:7.0f} b={b:7.1f}  -> {projected:9.0f} B at 4096")


if __name__ == "__main__":
    main()
