"""Startup cost: ``import kernelbay`` and ``kernelbay plugins`` with every installed plugin.

Baseline in the same run: a bare ``python -c pass``. Writes ``results.json`` and
``results.md`` next to this file (or ``--out``). Target: ``kernelbay plugins`` under 1 s.

    python bench/startup/run.py [--runs 15] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

CASES = {
    "python -c pass (baseline)": [sys.executable, "-c", "pass"],
    "import kernelbay": [sys.executable, "-c", "import kernelbay"],
    "kernelbay plugins --json": [sys.executable, "-m", "kernelbay.cli", "plugins", "--json"],
    "import torch (for scale)": [sys.executable, "-c", "import torch"],
}


def _time(cmd: list[str], runs: int) -> list[float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELBAY_")}
    subprocess.run(cmd, check=True, capture_output=True, env=env)  # warm the file cache
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env=env)
        times.append(time.perf_counter() - start)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    args = parser.parse_args()
    plugins = json.loads(subprocess.run(CASES["kernelbay plugins --json"], check=True,
                                        capture_output=True, text=True).stdout)
    rows = []
    baseline = None
    for label, cmd in CASES.items():
        times = _time(cmd, args.runs)
        median = statistics.median(times)
        baseline = baseline if baseline is not None else median
        rows.append({"case": label, "median_s": median, "min_s": min(times),
                     "max_s": max(times), "ratio_to_baseline": median / baseline})
    result = {
        "bench": "startup",
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "runs": args.runs,
        "plugins": [p["name"] for p in plugins["plugins"]],
        "rows": rows,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    lines = [f"startup, {args.runs} runs, plugins: {', '.join(result['plugins'])}", "",
             "| case | median (s) | min (s) | max (s) | x baseline |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['case']} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['max_s']:.3f} | "
              f"{r['ratio_to_baseline']:.1f} |" for r in rows]
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
