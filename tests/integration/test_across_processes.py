"""What must hold across processes: a restart is a new process, and a second one may run beside it.

The run hash, the corpus's tokens and a node's key are rebuilt identically by another interpreter; a
data dir's lock dies with the process that held it.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from protolearn.data_dir_lock import DataDirInUse, DataDirLock
from protolearn.protocol.identity import KEY_FILE, load_or_create_identity
from protolearn.stages.config import default_run
from protolearn.stages.corpus import load_corpus
from protolearn.stages.sampling import microbatch

from tests.support.runs import write_corpus

posix_only = pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")


def test_run_hash_is_stable_across_processes_and_sensitive_to_changes() -> None:
    code = "from protolearn.stages.config import default_run; print(default_run().run_hash())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == default_run().run_hash()
    assert default_run().replace(seed=1).run_hash() != default_run().run_hash()
    assert default_run().replace(**{"optim.lr": 0.001}).run_hash() != default_run().run_hash()


def test_another_process_rebuilds_identical_tokens(tmp_path: Path) -> None:
    run = default_run().replace(**{"data.path": str(write_corpus(tmp_path / "c", 30, "the quick brown fox jumps. ", 20)), "batch.seq_len": 32})
    x, y = microbatch(run, load_corpus(run.data), 3, 1)
    code = (
        "import hashlib, sys\n"
        "from protolearn.stages.config import RunConfig\n"
        "from protolearn.stages.corpus import load_corpus\n"
        "from protolearn.stages.sampling import microbatch\n"
        "run = RunConfig.from_toml_text(sys.stdin.read())\n"
        "x, y = microbatch(run, load_corpus(run.data), 3, 1)\n"
        "print(hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], input=run.to_toml(), capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()


@posix_only
def test_key_is_created_private_and_reused_across_processes(tmp_path: Path) -> None:
    data_dir = tmp_path / "node-a"
    ident = load_or_create_identity(data_dir)
    key = data_dir / KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
    assert key.read_bytes() == ident.private_bytes
    assert load_or_create_identity(data_dir).peer_id == ident.peer_id
    # a restart is a new process
    code = "import sys; from pathlib import Path; from protolearn.protocol.identity import load_or_create_identity as l; print(l(Path(sys.argv[1])).peer_id)"
    out = subprocess.run([sys.executable, "-c", code, str(data_dir)], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == ident.peer_id
    assert sorted(p.name for p in data_dir.iterdir()) == [KEY_FILE]  # no temp files left behind


def test_the_lock_of_a_killed_process_is_free_again(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from protolearn.data_dir_lock import DataDirLock; "
         f"l = DataDirLock({str(tmp_path / 'n')!r}); l.acquire(); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(DataDirInUse, match=f"process {holder.pid} "):
            DataDirLock(tmp_path / "n").acquire()
    finally:
        holder.kill()
        holder.wait(timeout=30)
        assert holder.stdout is not None
        holder.stdout.close()
    with DataDirLock(tmp_path / "n"):  # the kernel dropped the dead process's lock
        pass
