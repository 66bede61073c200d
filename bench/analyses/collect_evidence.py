"""Copy the records of finished evidence runs (recipe.yaml and eval/, not the weights) into the repository, so
that ``ea-hf compare --seeds`` and the docs' tables can be recomputed from committed files.

    python bench/analyses/collect_evidence.py                       # runs/evidence -> bench/results/evidence
    ea-hf compare --seeds --reference ea bench/results/evidence/minilm-rotten-tomatoes/*/*

A run counts once it has been evaluated (eval/<split>/metrics.json); runs still going are left for the next
call, so the evidence can be committed as it grows (``ea-hf run ... --skip-finished`` goes on where it stopped).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

RECORDS = ("recipe.yaml",)


def finished_runs(root: Path) -> list[Path]:
    """Run directories under ``root`` whose evaluation is written."""
    return sorted({path.parents[2] for path in root.glob("**/eval/*/metrics.json")})


def collect(source: Path, destination: Path) -> list[Path]:
    """Copy each finished run's recipe and evaluation records; the run directories written."""
    written = []
    for run_dir in finished_runs(source):
        target = destination / run_dir.relative_to(source)
        for name in RECORDS:
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(run_dir / name, target / name)
        shutil.copytree(run_dir / "eval", target / "eval", dirs_exist_ok=True)
        written.append(target)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", default="runs/evidence", type=Path)
    parser.add_argument("destination", nargs="?", default="bench/results/evidence", type=Path)
    args = parser.parse_args()
    for target in collect(args.source, args.destination):
        print(target)


if __name__ == "__main__":
    main()
