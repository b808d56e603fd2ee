"""Pool the per-request TTFTs of recorded ``bench_vllm.py`` runs and print each ratio with its
bootstrap interval, as ``bench_vllm.py`` prints it for one run.

    .venv/bin/python bench/vllm_pool.py bench/results/vllm-2026-12-02.txt --runs 14,15

A results file holds runs headed ``== run N (...)`` followed by ``per request:`` lines
(``LABEL LENGTH run I: MS ms, cached C``); only runs of the same connector code should be pooled."""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vllm import ratio_line  # noqa: E402

PAIRS = (("vLLM MooncakeStoreConnector", "kvwire / mooncake"),
         ("vLLM ExampleConnector", "kvwire / files, one engine, load in step"))
REQUEST = re.compile(r"^(\S.*?)\s+(\d+) run \d+:\s+([\d.]+) ms", re.M)


def requests(text: str, runs: set[str]) -> dict[tuple[str, int], list[float]]:
    """(label, prompt length) -> TTFTs in ms over the chosen runs."""
    out: dict[tuple[str, int], list[float]] = defaultdict(list)
    for block in re.split(r"^== run ", text, flags=re.M)[1:]:
        if block.split(maxsplit=1)[0] in runs:
            for label, length, ms in REQUEST.findall(block):
                out[(label.strip(), int(length))].append(float(ms))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--runs", required=True, help="run numbers to pool, e.g. 14,15")
    args = ap.parse_args()
    runs = set(args.runs.split(","))
    pooled: dict[tuple[str, int], list[float]] = defaultdict(list)
    for path in args.files:
        for key, values in requests(path.read_text(), runs).items():
            pooled[key] += values
    lengths = sorted({length for _, length in pooled})
    print(f"runs {args.runs} pooled; ratio of median TTFTs (above 1: kvwire faster), 90% bootstrap interval, "
          "pairs in which kvwire's request was the faster")
    for theirs, ours in PAIRS:
        print(f"{theirs} / {ours}:")
        for length in lengths:
            if pooled.get((theirs, length)) and pooled.get((ours, length)):
                print(f"  {length:6d}: {ratio_line(pooled[(theirs, length)], pooled[(ours, length)])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
