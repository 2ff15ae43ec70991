"""`gguf-mcv selftest` passes on a fresh install, offline."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_selftest_command_passes_offline(tmp_path: Path) -> None:
    env = {**os.environ, "GGUF_MCV_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "gguf_mcv", "selftest"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "PASS"
    assert sum(line.lstrip().startswith("ok") for line in lines) == 9
    assert (tmp_path / "selftest-model" / "ggml-model-Q4_K_M.gguf").is_file()
    assert any("MiniCPM-V 4.6" in line and line.lstrip().startswith("ok") for line in lines)
    assert (tmp_path / "selftest-model-4.6" / "ggml-model-Q4_K_M.gguf").is_file()


def test_selftest_reports_failure(tmp_path: Path) -> None:
    from gguf_mcv import selftest

    lines: list[str] = []
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the model folder should be")
    assert selftest.run(lines.append, model_dir=blocker / "model") is False
    assert lines[-1] == "FAIL"
    assert any(line.lstrip().startswith("FAIL") and "tiny test model" in line for line in lines)
