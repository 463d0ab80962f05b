"""README's demo table is what `make demo` prints: the table `make demo` prints under "ExGRPO demo: held-out sampled
accuracy" and the fenced block under "`make demo` printed" in README.md, compared cell by cell but for the wall
time row. On a difference, prints both rows of each and exits 1.

    python3 .ci/check_demo_table.py                  # runs make demo (~5 min on 2 cores)
    python3 .ci/check_demo_table.py --output FILE    # make demo's captured stdout instead
"""

from __future__ import annotations

import argparse
import itertools
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TITLE = "ExGRPO demo: held-out sampled accuracy"
README_LEAD = "`make demo` printed"
IGNORED_ROW = "wall time"


class TableNotFound(Exception):
    pass


def table_rows(text: str, source: str) -> list[tuple[str, ...]]:
    """The cells of each row of the table titled TITLE in `text` (header included, border lines and the wall time
    row left out)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == TITLE), None)
    if start is None:
        raise TableNotFound(f"{source} holds no table titled {TITLE!r}")
    rows = []
    for line in itertools.takewhile(lambda line: not line.lstrip().startswith("└"), lines[start + 1:]):
        cells = tuple(cell.strip() for cell in re.split("[│┃]", line.strip())[1:-1])
        if cells and not cells[0].startswith(IGNORED_ROW):
            rows.append(cells)
    if not rows:
        raise TableNotFound(f"{source} holds the title {TITLE!r} but no table rows under it")
    return rows


def readme_block(readme: str) -> str:
    """The first fenced block after the line that starts with README_LEAD."""
    lead = readme.find("\n" + README_LEAD)
    if lead < 0:
        raise TableNotFound(f"README.md has no line starting with {README_LEAD!r}")
    fenced = re.search(r"^```[^\n]*\n(.*?)^```", readme[lead:], re.DOTALL | re.MULTILINE)
    if fenced is None:
        raise TableNotFound(f"README.md has no fenced block after {README_LEAD!r}")
    return fenced.group(1)


def differing_rows(readme: list[tuple[str, ...]], printed: list[tuple[str, ...]]) -> list[tuple]:
    """(README's row, the printed row) for each position where they differ; None where one table has no row."""
    return [(a, b) for a, b in itertools.zip_longest(readme, printed) if a != b]


def demo_output() -> str:
    """`make demo`'s stdout, echoed; its stderr goes through."""
    result = subprocess.run(["make", "demo"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    sys.stdout.write(result.stdout)
    if result.returncode != 0:
        raise TableNotFound(f"make demo exited {result.returncode}")
    return result.stdout


def captured(path: Path) -> str:
    """The text of --output FILE; bytes that are not UTF-8 are a TableNotFound naming the file."""
    try:
        return path.read_text()
    except UnicodeDecodeError as e:
        raise TableNotFound(f"--output {path}: not UTF-8 text ({e.reason} at byte {e.start}); expected make demo's "
                            "captured stdout") from None


def show(row: tuple[str, ...] | None) -> str:
    return " │ ".join(row) if row is not None else "(no such row)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, metavar="FILE",
                        help="make demo's captured stdout, instead of running make demo")
    args = parser.parse_args(argv)
    try:
        printed = captured(args.output) if args.output else demo_output()
        want = table_rows(readme_block((ROOT / "README.md").read_text()), "README.md's block")
        got = table_rows(printed, "make demo's output")
    except (TableNotFound, OSError) as missing:
        print(f"check_demo_table: {missing}", file=sys.stderr)
        return 1
    differences = differing_rows(want, got)
    for readme_row, printed_row in differences:
        print(f"README.md: {show(readme_row)}\nmake demo: {show(printed_row)}")
    if differences:
        print("README's demo table is not what make demo prints: update README.md (and its date and commit)")
        return 1
    print(f"README's demo table is what make demo prints ({len(got)} rows; the wall time aside)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
