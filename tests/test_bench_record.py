"""gguf_mcv.testing.bench_record: the record every benchmark writes says where and how it ran."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from gguf_mcv.testing import bench_record


def test_a_record_names_the_run_the_machine_and_the_results() -> None:
    rec = bench_record.record("bench_x", {"ttft_s": 1.5}, settings={"threads": 2},
                              argv=["tools/bench_x.py", "--threads", "2", "--json", "out file.json"])
    assert rec["benchmark"] == "bench_x" and rec["results"] == {"ttft_s": 1.5}
    assert rec["settings"] == {"threads": 2}
    assert rec["command"] == "python tools/bench_x.py --threads 2 --json 'out file.json'"  # quoted to run again
    assert rec["date"].endswith("+00:00")
    machine = rec["machine"]
    assert machine["logical_cpus"] >= 1 and machine["ram_bytes"] > 0
    assert set(machine["versions"]) >= {"gguf_mcv", "llama_cpp_python", "onnxruntime", "numpy"}
    json.dumps(rec)  # all of it is JSON


def test_a_command_is_its_program_name_unless_it_is_a_script() -> None:
    assert bench_record.command(["/usr/local/bin/gguf-mcv", "bench", "m.gguf"]) == "gguf-mcv bench m.gguf"
    assert bench_record.command([]) == ""


def test_the_cpu_class_comes_from_the_flags() -> None:
    assert bench_record.cpu_class(frozenset({"avx2", "avx512f", "amx_tile"})) == "avx512-amx"
    assert bench_record.cpu_class(frozenset({"avx2", "avx512f"})) == "avx512"
    assert bench_record.cpu_class(frozenset({"avx2", "fma"})) == "avx2"
    assert bench_record.cpu_class(frozenset({"asimd", "asimddp"})) == "arm-dotprod"
    assert bench_record.cpu_class(frozenset()) not in ("avx2", "avx512")


def test_the_commit_is_the_checkouts_and_says_when_files_differ(tmp_path: Path) -> None:
    assert bench_record.commit(tmp_path) is None  # not a checkout
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.txt").write_text("one")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    head = bench_record.commit(tmp_path)
    assert head is not None and len(head) == 12 and not head.endswith("-dirty")
    (tmp_path / "a.txt").write_text("two")
    assert bench_record.commit(tmp_path) == head + "-dirty"
