""".ci/check_demo_table.py on README's own demo table, without running the demo: the same table passes, whatever
its wall time; a changed accuracy fails with both rows printed."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("check_demo_table", ROOT / ".ci" / "check_demo_table.py")
check_demo_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_demo_table)

README_TABLE = check_demo_table.readme_block((ROOT / "README.md").read_text())


def _check(tmp_path, printed: str) -> int:
    output = tmp_path / "demo.out"
    output.write_text(f"make's echo\nexgrpo demo: ...\n{printed}report: runs/demo/report.md\n")
    return check_demo_table.main(["--output", str(output)])


def _changed(row_label: str, new_cell: str) -> str:
    """README's table with the value cell of the row starting with `row_label` replaced (same width or not)."""
    pattern = rf"(│ {re.escape(row_label)}[^│]*│)[^│]*│"
    changed, count = re.subn(pattern, rf"\g<1> {new_cell} │", README_TABLE)
    assert count == 1, row_label
    return changed


def test_readmes_own_table_passes(tmp_path, capsys):
    assert len(check_demo_table.table_rows(README_TABLE, "README")) == 6  # header and five rows, no wall time
    assert _check(tmp_path, README_TABLE) == 0
    assert "is what make demo prints" in capsys.readouterr().out


def test_another_wall_time_passes(tmp_path):
    assert _check(tmp_path, _changed("wall time", "123.4 min")) == 0


def test_a_changed_accuracy_fails_with_both_rows(tmp_path, capsys):
    readme_row = next(line for line in README_TABLE.splitlines() if "held-out accuracy after" in line)
    assert _check(tmp_path, _changed("held-out accuracy after", "1.0% ± 0.1 (n=61×4)")) == 1
    out = capsys.readouterr().out
    readme_value = readme_row.split("│")[2].strip()
    assert f"README.md: held-out accuracy after │ {readme_value}" in out
    assert "make demo: held-out accuracy after │ 1.0% ± 0.1 (n=61×4)" in out


def test_a_missing_row_or_table_fails(tmp_path, capsys):
    without_replays = "\n".join(line for line in README_TABLE.splitlines() if "replayed" not in line)
    assert _check(tmp_path, without_replays) == 1
    assert "make demo: (no such row)" in capsys.readouterr().out
    assert _check(tmp_path, "no table here\n") == 1
    assert "holds no table titled" in capsys.readouterr().err


def test_a_title_without_rows_or_a_file_that_is_not_text_is_said(tmp_path, capsys):
    """An empty table was 'not what make demo prints: update README.md' with every README row missing; bytes that
    are not UTF-8 ended in a UnicodeDecodeError traceback."""
    assert _check(tmp_path, f"{check_demo_table.TITLE}\n") == 1
    assert "holds the title 'ExGRPO demo: held-out sampled accuracy' but no table rows" in capsys.readouterr().err
    binary = tmp_path / "demo.bin"
    binary.write_bytes(b"\xff\xfe")
    assert check_demo_table.main(["--output", str(binary)]) == 1
    assert capsys.readouterr().err == f"check_demo_table: --output {binary}: not UTF-8 text (invalid start byte at " \
        "byte 0); expected make demo's captured stdout\n"
