"""tools/bench/, the benchmark harness: fresh processes and their memory, alternating runs,
percentiles, the record, and every benchmark script built on it."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))

from bench import fresh, memory, options, record, stats  # noqa: E402

#: scripts under tools/ that are not benchmarks built on the harness, and why
NOT_ON_THE_HARNESS = {
    "make_bad_inputs.py": "a factory of hostile inputs, loaded by tests/test_corpus.py from its path",
}


def test_a_fresh_call_returns_the_result_and_the_memory_it_took() -> None:
    run = fresh.call("bench.memory:own_peak")
    assert run.returncode == 0 and isinstance(run.result, int) and run.result > 0
    assert run.checked() == run.result
    assert run.child_vmhwm is not None and run.child_vmhwm >= run.result
    assert run.peak_tree_rss > 0 and run.wall_s > 0 and run.cpu_s >= 0


def test_the_peak_counts_what_the_child_allocated() -> None:
    small = fresh.run(["-c", "from bench.fresh import emit; emit(1)"])
    big = fresh.run(["-c", "b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); "
                     "from bench.fresh import emit; emit(len(b))"])
    assert big.result == 200 * 2**20
    assert big.child_vmhwm - small.child_vmhwm > 150 * 2**20


def test_the_result_is_the_last_result_line_whatever_else_is_printed() -> None:
    code = ("print('noise'); print('BENCH-RESULT {\"result\": 0, \"vmhwm\": 0}'); from bench.fresh import emit; "
            "emit({'a': 1}); print('after')")
    assert fresh.run(["-c", code]).result == {"a": 1}


def test_a_failed_child_has_no_result_and_checked_says_why() -> None:
    run = fresh.run(["-c", "import sys; sys.stderr.write('it broke'); sys.exit(3)"])
    assert run.returncode == 3 and run.result is None and "it broke" in run.stderr_tail
    with pytest.raises(SystemExit, match="exit status 3"):
        run.checked()


def test_a_child_past_its_timeout_is_killed() -> None:
    run = fresh.run(["-c", "import time; time.sleep(60)"], timeout=1)
    assert run.returncode == -9 and run.result is None and run.wall_s < 30


def test_a_child_gets_the_extra_environment() -> None:
    run = fresh.run(["-c", "import os; from bench.fresh import emit; emit(os.environ['BENCH_TEST'])"],
                    env={"BENCH_TEST": "seen"})
    assert run.result == "seen"


def test_status_reads_this_processes_memory() -> None:
    own = memory.status()
    assert set(own) == set(memory.FIELDS) and own["VmHWM"] >= own["VmRSS"] > 0
    assert memory.status(2**22 + 12345) == {}  # no such process


def test_alternate_takes_turns_and_swap_reverses_every_other_round() -> None:
    order: list[str] = []
    runs = {name: (lambda name=name: order.append(name) or len(order)) for name in "AB"}
    samples = stats.alternate(runs, 3)
    assert order == list("ABABAB") and samples == {"A": [1, 3, 5], "B": [2, 4, 6]}
    order.clear()
    stats.alternate(runs, 3, swap=True)
    assert order == list("ABBAAB")
    with pytest.raises(ValueError):
        stats.alternate(runs, 0)


def test_a_ratio_pairs_rounds_and_percentiles_take_the_nearest_rank() -> None:
    r = stats.ratio([2.0, 3.0, 8.0], [1.0, 1.0, 2.0])
    assert r["n"] == 3 and r["median"] == 3.0 and r["min"] == 2.0 and r["max"] == 4.0
    with pytest.raises(ValueError, match="differ in number"):
        stats.ratio([1.0], [1.0, 2.0])
    assert stats.percentile([], 50) is None
    assert stats.percentile([5.0, 1.0, 3.0], 50) == 3.0 and stats.percentile([5.0, 1.0, 3.0], 100) == 5.0
    assert stats.summary([])["median"] is None


def test_the_shared_options_and_the_record_written(tmp_path: Path) -> None:
    p = options.parser("A benchmark.\n\nMore.", ladder=None, threads=None)
    args = p.parse_args(["--ladder", str(tmp_path), "--json", str(tmp_path / "r.json")])
    assert args.quant == "Q4_K_M" and args.threads is None and args.ladder == tmp_path
    with pytest.raises(SystemExit):
        p.parse_args([])  # --ladder required
    bare = options.parser(None, quant=options.OMIT, threads=options.OMIT, json=False).parse_args([])
    assert vars(bare) == {}
    rec = record.write(args.json, "bench_test", {"x": 1}, args)
    written = json.loads((tmp_path / "r.json").read_text())
    assert written == rec and written["results"] == {"x": 1}
    assert written["settings"] == {"ladder": str(tmp_path), "quant": "Q4_K_M", "threads": None}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
    return names


@pytest.mark.parametrize("script", sorted(p.name for p in TOOLS.glob("*.py")))
def test_every_tool_is_built_on_the_harness(script: str) -> None:
    """No tool keeps its own path hack, argument boilerplate or JSON layout: the harness has them."""
    if script in NOT_ON_THE_HARNESS:
        pytest.skip(NOT_ON_THE_HARNESS[script])
    path = TOOLS / script
    assert "bench" in _imports(path), f"{script} does not use tools/bench"
    text = path.read_text()
    assert "sys.path.insert(0, str(Path(__file__)" not in text
    assert 'open("/proc/self/status")' not in text, "memory figures come from bench.memory"


def test_every_tool_imports() -> None:
    """Each script's imports resolve (a renamed module breaks no tool unnoticed); one process for all."""
    scripts = [p.stem for p in TOOLS.glob("*.py") if p.name not in NOT_ON_THE_HARNESS]
    code = ("import importlib, sys\n"
            f"for name in {scripts!r}:\n"
            "    module = importlib.import_module(name)\n"
            "    assert callable(getattr(module, 'main', None)), name\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=fresh.env_for_child())
    assert done.returncode == 0, done.stderr[-3000:]
