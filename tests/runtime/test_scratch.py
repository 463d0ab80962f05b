"""Temporary directories carry their owner's pid; the next one made removes those of processes that are gone."""

import os
import subprocess
import sys

from exgrpo.runtime.scratch import owned_temp_dir


def test_a_new_directory_sweeps_those_of_dead_owners_only(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"exgrpo-test-{int(gone.stdout)}-abc"
    mine = tmp_path / f"exgrpo-test-{os.getpid()}-def"
    other_kind = tmp_path / f"exgrpo-other-{int(gone.stdout)}-ghi"
    for d in (dead, mine, other_kind):
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "weights.safetensors").write_bytes(b"x" * 10)
    new = owned_temp_dir("exgrpo-test-", str(tmp_path))
    assert os.path.basename(new).startswith(f"exgrpo-test-{os.getpid()}-")
    assert not dead.exists() and mine.is_dir() and other_kind.is_dir()
