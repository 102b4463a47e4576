"""How rankguard's cross-rank checks grow with world size (gloo, CPU processes).

For world sizes 2, 4, 8, 16, 32 (simulated nodes of 4 ranks, one torchrun per
node, master on 127.0.0.1; see ``benchmarks/scale_worker.py``) it prints:

1. the fit-start checks of every guard, as ``RankGuard()`` runs them, on the
   deciding rank (0) and the slowest other rank: wall time and CPU time. With
   more processes than cores, wall time mostly measures waiting for the
   scheduler to run the other ranks; CPU time is each rank's own work; 1b. what
   a resumed fit's start adds (the resume check's exchange);
2. the hang watchdog's status exchange (its real background thread): CPU
   time per exchange and bytes per exchange;
3. per check (guard and event): store exchanges, bytes sent and received on
   rank 0 and on another rank, at every world size measured;
4. least-squares fits ``y = a + b * world`` projected to 4096 ranks (straight lines
   through small sizes, a check of growth only: ``benchmarks/store_load.py`` measures
   1,024 to 16,384 ranks against one store);
5. the straggler monitor's interval exchange (a background thread): the main
   thread's time at the batch that posts it and at the one that collects the
   verdict, rank 0's decide time, bytes, fitted and projected likewise.

Usage: ``python benchmarks/scale.py [--sizes 2,4,8,16,32] [--repeats 3]
[--only straggler_monitor]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from launch import launch_nodes  # noqa: E402

PROJECT_TO = 4096


def measure(world: int, repeats: int, only: str | None = None) -> dict:
    per_node = min(world, 4)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "scale.json"
        args = [str(out), "--repeats", str(repeats), "--folder", str(Path(tmp) / "ckpt")]
        args += ["--only", only] if only else []
        results = launch_nodes(
            HERE / "scale_worker.py", args, world // per_node, per_node, timeout=900
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


def straggler_section(runs: dict[int, list[dict]], number: int) -> None:
    """The straggler monitor's interval exchange at each world size, and the fits."""
    print(f"\n{number}. straggler monitor interval exchange (background thread), per exchange")
    print(
        f"{'world':>5} | {'post ms':>7} {'collect ms':>10} {'collect max':>11} | "
        f"{'decide ms r0':>12} | "
        f"{'bytes in r0':>11} {'other sent/recv':>15}"
    )
    rows = []
    for world, ranks in runs.items():
        zero = ranks[0]["checks"]["straggler_monitor"]["interval"]
        others = [r["checks"]["straggler_monitor"]["interval"] for r in ranks[1:]]
        row = {
            "world": world,
            "post": 1000 * max(o["post_wall_s"] for o in [zero, *others]),
            "collect": 1000 * max(o["collect_wall_s"] for o in [zero, *others]),
            "collect_max": 1000 * max(o["collect_wall_max_s"] for o in [zero, *others]),
            "decide0": 1000 * zero["decide_s"],
            "in0": zero["received"],
        }
        rows.append(row)
        other = others[-1]
        print(
            f"{world:>5} | {row['post']:>7.2f} {row['collect']:>10.2f} {row['collect_max']:>11.2f}"
            f" | {row['decide0']:>12.3f} | "
            f"{row['in0']:>11.0f} {other['sent']:>7.0f}/{other['received']:<7.0f}"
        )
    worlds = [r["world"] for r in rows]
    for key, label, unit in (("decide0", "decide, rank 0", "ms"), ("in0", "bytes in, rank 0", "B")):
        a, b = fit(worlds, [r[key] for r in rows])
        print(f"  {label:<38} a={a:9.3f} b={b:8.4f} -> {a + b * PROJECT_TO:10.1f} {unit}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,4,8,16,32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=["straggler_monitor"], default=None)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    runs = {world: measure(world, args.repeats, args.only)["ranks"] for world in sizes}
    if args.only:
        straggler_section(runs, 1)
        return

    print("1. fit-start checks of every guard (median of repeats), ms")
    print(
        f"{'world':>5} | {'wall rank 0':>11} {'wall others max':>15} | "
        f"{'CPU rank 0':>10} {'CPU others max':>14} | {'decide rank 0':>13}"
    )
    rows = []
    for world, ranks in runs.items():
        leader, others = ranks[0], ranks[1:]
        row = {
            "world": world,
            "wall0": 1000 * leader["fit_start"]["wall_s"],
            "wall_o": 1000 * max(r["fit_start"]["wall_s"] for r in others),
            "cpu0": 1000 * leader["fit_start"]["cpu_s"],
            "cpu_o": 1000 * max(r["fit_start"]["cpu_s"] for r in others),
            "decide0": 1000
            * sum(
                leader["checks"][name]["fit_start"]["decide_s"]
                for name in leader["checks"]
                if "fit_start" in leader["checks"][name]
            ),
            "resume_wall0": 1000 * leader["checks"]["resume_guard"]["resumed"]["wall_s"],
            "resume_cpu0": 1000 * leader["checks"]["resume_guard"]["resumed"]["cpu_s"],
            "resume_cpu_o": 1000
            * max(r["checks"]["resume_guard"]["resumed"]["cpu_s"] for r in others),
            "resume_in0": leader["checks"]["resume_guard"]["resumed"]["received"],
            "status_cpu0": 1000 * leader["checks"]["hang_watchdog"]["status"]["cpu_s"],
            "status_cpu_o": 1000
            * max(r["checks"]["hang_watchdog"]["status"]["cpu_s"] for r in others),
            "status_decide0": 1000 * leader["checks"]["hang_watchdog"]["status"]["decide_s"],
            "status_in0": leader["checks"]["hang_watchdog"]["status"]["received"],
            "status_o": max(
                r["checks"]["hang_watchdog"]["status"]["sent"]
                + r["checks"]["hang_watchdog"]["status"]["received"]
                for r in others
            ),
        }
        rows.append(row)
        print(
            f"{world:>5} | {row['wall0']:>11.1f} {row['wall_o']:>15.1f} | "
            f"{row['cpu0']:>10.1f} {row['cpu_o']:>14.1f} | {row['decide0']:>13.2f}"
        )

    print(
        "\n1b. a resumed fit's start adds the resume check (one exchange; a fresh fit's start "
        "none), ms"
    )
    print(
        f"{'world':>5} | {'wall rank 0':>11} | {'CPU rank 0':>10} {'CPU others max':>14} | "
        f"{'bytes in, rank 0':>16}"
    )
    for row in rows:
        print(
            f"{row['world']:>5} | {row['resume_wall0']:>11.1f} | {row['resume_cpu0']:>10.1f} "
            f"{row['resume_cpu_o']:>14.1f} | {row['resume_in0']:>16.0f}"
        )

    print("\n2. hang watchdog status exchange (real thread, period 0.5 s), per exchange")
    print(
        f"{'world':>5} | {'CPU ms rank 0':>13} {'CPU ms others max':>17} | "
        f"{'decide ms rank 0':>16} | {'bytes in, rank 0':>16} {'bytes in+out, other':>19}"
    )
    for row in rows:
        print(
            f"{row['world']:>5} | {row['status_cpu0']:>13.2f} {row['status_cpu_o']:>17.2f} | "
            f"{row['status_decide0']:>16.3f} | {row['status_in0']:>16.0f} "
            f"{row['status_o']:>19.0f}"
        )

    print(
        "\n3. per check: exchanges, bytes sent/received per occurrence "
        "(rank 0 | another rank), at each world size"
    )
    last = runs[sizes[-1]]
    for name, checks in last[0]["checks"].items():
        for event in checks:
            cells = []
            for world in sizes:
                zero = runs[world][0]["checks"][name][event]
                other = runs[world][-1]["checks"][name][event]
                cells.append(
                    f"{world}: {zero['sent']:.0f}/{zero['received']:.0f} | "
                    f"{other['sent']:.0f}/{other['received']:.0f}"
                )
            exchanges = last[-1]["checks"][name][event]["exchanges"]
            print(f"  {name}/{event} ({exchanges:g} exchange(s)): " + "; ".join(cells))

    worlds = [r["world"] for r in rows]
    print(f"\n4. fitted y = a + b * world, projected to {PROJECT_TO} ranks")
    for key, label, unit in (
        ("cpu0", "fit-start CPU, rank 0", "ms"),
        ("cpu_o", "fit-start CPU, slowest other", "ms"),
        ("decide0", "fit-start decide, rank 0", "ms"),
        ("wall0", "fit-start wall, rank 0", "ms"),
        ("resume_cpu0", "resume check CPU, rank 0", "ms"),
        ("resume_in0", "resume check bytes in, rank 0", "B"),
        ("status_cpu0", "status exchange CPU, rank 0", "ms"),
        ("status_cpu_o", "status exchange CPU, other", "ms"),
        ("status_in0", "status bytes in, rank 0", "B"),
        ("status_o", "status bytes in+out, other", "B"),
    ):
        a, b = fit(worlds, [r[key] for r in rows])
        print(f"  {label:<32} a={a:9.2f} b={b:8.3f} -> {a + b * PROJECT_TO:10.1f} {unit}")
    straggler_section(runs, 5)


if __name__ == "__main__":
    main()
