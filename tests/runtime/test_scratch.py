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


def test_a_servers_scratch_shares_torchs_compile_cache_and_its_removal_keeps_it(tmp_path, monkeypatch):
    """torch puts precompiled headers under <temp dir>/torchinductor_<user>; in a server's scratch that is a link to
    the shared cache, so they are compiled once and not left behind in every server's scratch."""
    import getpass
    import tempfile

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from exgrpo.rollout.serve import share_compile_cache
    from exgrpo.runtime.scratch import remove_orphans

    shared = tmp_path / "shared-cache"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    scratch = tmp_path / f"exgrpo-serve-{int(gone.stdout)}-abc"
    scratch.mkdir()
    share_compile_cache(str(scratch), str(shared))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # the server's TMPDIR
    header = os.path.join(default_cache_dir(), "precompiled_headers", "x.h.gch")  # where torch writes them
    os.makedirs(os.path.dirname(header))
    open(header, "wb").close()
    assert (shared / "precompiled_headers" / "x.h.gch").is_file()
    assert (scratch / f"torchinductor_{getpass.getuser()}").is_symlink()
    remove_orphans("exgrpo-serve-", str(tmp_path))  # the next server sweeps this one's scratch
    assert not scratch.exists() and (shared / "precompiled_headers" / "x.h.gch").is_file()
