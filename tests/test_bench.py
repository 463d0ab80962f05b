"""The GPU check runs here on CPU at toy sizes (`--smoke`), so the script a GPU session runs once is not broken."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_every_part_on_cpu(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["tiny_training"]["steps"] == 2 and report["fsdp_one_rank"]["grads"]
    shaped = report["qwen2.5_1.5b_shape"]
    assert shaped["tokens"] == 512 and shaped["train_tokens_per_s"] > 0 and shaped["decode_tokens"] > 0
