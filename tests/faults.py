"""`python -m faults ARGS`: the `exgrpo` CLI, SIGKILLed at an exact point instead of after a sleep.

`EXGRPO_KILL_AT="rmtree:.deleting-step-000006"` kills the process as `shutil.rmtree` is called on a path whose name
starts with `.deleting-step-000006`; `replace:` does the same for the source or target of `os.replace`, and an
`after-` prefix (`after-replace:.tmp-step-000005`) kills right after the call returns. Only these library calls are
wrapped: exgrpo's own code runs unchanged, and where the kill lands never depends on timing.
"""

import os
import shutil
import signal
import sys
from pathlib import Path


def _kill_at(spec: str) -> None:
    when, _, prefix = spec.partition(":")
    after = when.startswith("after-")
    module, name = {"rmtree": (shutil, "rmtree"), "replace": (os, "replace")}[when.removeprefix("after-")]
    original = getattr(module, name)

    def wrapped(*args, **kwargs):
        hit = any(isinstance(a, (str, os.PathLike)) and Path(a).name.startswith(prefix) for a in args[:2])
        if hit and not after:
            os.kill(os.getpid(), signal.SIGKILL)
        result = original(*args, **kwargs)
        if hit:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(module, name, wrapped)


if __name__ == "__main__":
    if os.environ.get("EXGRPO_KILL_AT"):
        _kill_at(os.environ["EXGRPO_KILL_AT"])
    from exgrpo.cli import main

    sys.exit(main(sys.argv[1:]))
