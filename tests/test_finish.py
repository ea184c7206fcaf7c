"""``ds_adabatch.finish``: the last call of a rank's script ends it with the given code, output intact."""

from __future__ import annotations

import subprocess
import sys

from _util import torchrun

SCRIPT = """
import logging, sys
import torch.distributed as dist
import ds_adabatch
logging.basicConfig(stream=sys.stderr, level=logging.INFO)
if len(sys.argv) > 1:
    dist.init_process_group("gloo")
    t = __import__("torch").ones(1)
    dist.all_reduce(t)
    sys.stdout.write(f"rank {dist.get_rank()} sum {int(t.item())}")  # no newline: still buffered
else:
    sys.stdout.write("no group")
logging.getLogger("job").info("logged before finish")
ds_adabatch.finish(int(sys.argv[2]) if len(sys.argv) > 2 else 7)
raise SystemExit("finish returned")
"""


def test_finish_flushes_and_exits_with_the_code(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 7, proc.stderr
    assert proc.stdout == "no group"
    assert "logged before finish" in proc.stderr
    assert "finish returned" not in proc.stderr


def test_finish_on_two_gloo_ranks(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    proc = torchrun(script, "group", "0", nproc=2, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"rank {rank} sum 2" in proc.stdout
    assert "finish returned" not in proc.stderr
