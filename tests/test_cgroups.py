"""What a cgroup memory limit leaves (gguf_mcv.cgroups): recorded and written trees, a property
test, and real cgroups where this machine lets us make them (root and a memory controller)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gguf_mcv.cgroups import memory_limit, unreclaimable
from gguf_mcv.testing.memory_cgroup import MemoryCgroup

MiB = 2**20
GB = 10**9
HOST = 64 * 2**30  # a host far larger than any limit below
TREES = Path(__file__).parent / "data" / "cgroup_trees"


def tree(name: str, tmp_path: Path) -> Path:
    """A copy of a recorded tree (the copy may be changed by the test)."""
    shutil.copytree(TREES / name, tmp_path / name)
    return tmp_path / name


def make_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


# --- recorded cgroup v1 trees ----------------------------------------------------------------
# Recorded on Linux 6.18 (cgroup v1 memory controller) by a process idling in a 768 MiB cgroup:
# v1-first-run before anything else ran there; v1-second-run after another process read a
# 192 MiB file twice (all of it active_file), mapped 64 MiB of it and exited; v1-mapped while a
# process maps those 64 MiB; v1-shmem after a process wrote 64 MiB to /dev/shm and exited;
# v1-nested: a pod of 512 MiB whose other container holds 64 MiB of /dev/shm.


def test_recorded_v1_second_run_leaves_what_the_first_did(tmp_path: Path) -> None:
    first = memory_limit(tree("v1-first-run", tmp_path), HOST)
    second = memory_limit(tree("v1-second-run", tmp_path), HOST)
    assert first is not None and second is not None
    assert (first.limit, first.source) == (second.limit, second.source) == (768 * MiB, "cgroup v1")
    usage = [int(next(t.rglob("memory.usage_in_bytes")).read_text()) for t in tmp_path.iterdir()]
    assert max(usage) - min(usage) > 190 * MiB  # the first run's page cache is still charged
    assert abs(first.headroom - second.headroom) <= MiB


def test_recorded_v1_mapped_file_pages_are_used(tmp_path: Path) -> None:
    first = memory_limit(tree("v1-first-run", tmp_path), HOST)
    mapped = memory_limit(tree("v1-mapped", tmp_path), HOST)
    assert first is not None and mapped is not None
    assert mapped.headroom <= first.headroom - 64 * MiB  # the mapped part, and the mapper's own memory


def test_recorded_v1_shmem_is_used(tmp_path: Path) -> None:
    first = memory_limit(tree("v1-first-run", tmp_path), HOST)
    shmem = memory_limit(tree("v1-shmem", tmp_path), HOST)
    assert first is not None and shmem is not None
    assert first.headroom - 68 * MiB <= shmem.headroom <= first.headroom - 64 * MiB


def test_recorded_v1_nested_parent_limit_and_sibling_usage(tmp_path: Path) -> None:
    limit = memory_limit(tree("v1-nested", tmp_path), HOST)
    assert limit is not None
    assert limit.limit == 512 * MiB  # the pod's, not the container's unlimited own
    assert limit.headroom <= 512 * MiB - 64 * MiB  # the other container's shmem counts


def test_recorded_v1_container_that_sees_only_its_own_cgroup(tmp_path: Path) -> None:
    """Inside a container the mount's top is its own cgroup: the parent's limit is read from
    ``hierarchical_memory_limit`` (its siblings' usage cannot be seen)."""
    root = tree("v1-nested", tmp_path)
    mount = root / "sys/fs/cgroup/memory"
    for f in (mount / "kubepods/pod/ctr").iterdir():
        shutil.copy(f, mount / f.name)
    shutil.rmtree(mount / "kubepods")
    limit = memory_limit(root, HOST)
    assert limit is not None and limit.limit == 512 * MiB
    assert 500 * MiB < limit.headroom < 512 * MiB  # the container's own few MiB


# --- cgroup v2 trees, written in the kernel's memory.stat layout -------------------------------
# (No v2 memory controller to record on this machine: these follow the v2 field list, with
# memory.current the sum the kernel charges: anon + file + kernel + sock.)


def v2_files(folder: str, limit: int | str, *, high: str = "max", anon: int = 0, active_file: int = 0,
             inactive_file: int = 0, shmem: int = 0, file_mapped: int = 0, file_dirty: int = 0,
             file_writeback: int = 0, slab_reclaimable: int = 0, slab_unreclaimable: int = 0,
             kernel_stack: int = 0, pagetables: int = 0, sock: int = 0) -> dict[str, str]:
    file = active_file + inactive_file + shmem
    slab = slab_reclaimable + slab_unreclaimable
    kernel = slab + kernel_stack + pagetables
    stat = {
        "anon": anon, "file": file, "kernel": kernel, "kernel_stack": kernel_stack, "pagetables": pagetables,
        "sec_pagetables": 0, "percpu": 0, "sock": sock, "vmalloc": 0, "shmem": shmem, "zswap": 0, "zswapped": 0,
        "file_mapped": file_mapped, "file_dirty": file_dirty, "file_writeback": file_writeback, "swapcached": 0,
        "anon_thp": 0, "file_thp": 0, "shmem_thp": 0, "inactive_anon": anon + shmem, "active_anon": 0,
        "inactive_file": inactive_file, "active_file": active_file, "unevictable": 0,
        "slab_reclaimable": slab_reclaimable, "slab_unreclaimable": slab_unreclaimable, "slab": slab,
        "workingset_refault_anon": 0, "workingset_refault_file": 1000, "pgfault": 511242, "pgmajfault": 14,
    }
    return {
        f"{folder}/memory.max": f"{limit}\n",
        f"{folder}/memory.high": f"{high}\n",
        f"{folder}/memory.current": f"{anon + file + kernel + sock}\n",
        f"{folder}/memory.stat": "".join(f"{k} {v}\n" for k, v in stat.items()),
    }


DOCKER_V2 = {"proc/self/cgroup": "0::/\n"}  # a container's own cgroup is the mount's top
LIMIT = 1_700_000_000  # the cgroup
BASE = dict(anon=12 * MiB, slab_reclaimable=9 * MiB, slab_unreclaimable=3 * MiB, kernel_stack=MiB, pagetables=MiB)
USED = 12 * MiB + 3 * MiB + MiB + MiB  # anon + unreclaimable kernel memory


def v2_headroom(tmp_path: Path, **parts: int) -> int:
    root = make_tree(tmp_path / "v2", {**DOCKER_V2, **v2_files("sys/fs/cgroup", LIMIT, **{**BASE, **parts})})
    limit = memory_limit(root, HOST)
    assert limit is not None and limit.limit == LIMIT and limit.source == "cgroup v2"
    return limit.headroom


def test_v2_first_run(tmp_path: Path) -> None:
    assert v2_headroom(tmp_path) == LIMIT - USED


def test_v2_second_run_with_the_first_runs_active_page_cache(tmp_path: Path) -> None:
    """The issue's case: the model files the first run read stay charged, mostly as active_file."""
    assert v2_headroom(tmp_path, active_file=1_250 * MiB, inactive_file=180 * MiB) == LIMIT - USED


@pytest.mark.parametrize("kind", ["file_mapped", "file_dirty", "file_writeback"])
def test_v2_mapped_dirty_and_writeback_pages_are_used(tmp_path: Path, kind: str) -> None:
    assert v2_headroom(tmp_path, active_file=1_000 * MiB, **{kind: 600 * MiB}) == LIMIT - USED - 600 * MiB


def test_v2_shmem_and_sockets_are_used(tmp_path: Path) -> None:
    assert v2_headroom(tmp_path, active_file=500 * MiB, shmem=200 * MiB, sock=5 * MiB) == LIMIT - USED - 205 * MiB


def test_v2_mapped_shmem_counts_once_more_at_most(tmp_path: Path) -> None:
    """Mapped shmem is in both file_mapped and shmem: never counted as free."""
    headroom = v2_headroom(tmp_path, active_file=300 * MiB, shmem=100 * MiB, file_mapped=100 * MiB)
    assert LIMIT - USED - 200 * MiB <= headroom <= LIMIT - USED - 100 * MiB


def test_v2_memory_high_binds_below_memory_max(tmp_path: Path) -> None:
    files = v2_files("sys/fs/cgroup", LIMIT, high=str(GB), **BASE)
    limit = memory_limit(make_tree(tmp_path, {**DOCKER_V2, **files}), HOST)
    assert limit is not None and (limit.limit, limit.headroom) == (GB, GB - USED)


def test_v2_nested_parent_is_tighter_and_counts_its_other_children(tmp_path: Path) -> None:
    pod, ctr = "sys/fs/cgroup/kubepods/pod1", "sys/fs/cgroup/kubepods/pod1/ctr"
    files = {
        "proc/self/cgroup": "0::/kubepods/pod1/ctr\n",
        **v2_files(ctr, 4 * GB, anon=100 * MiB, active_file=800 * MiB),
        # the pod: this container plus a sidecar with 300 MiB of anonymous memory
        **v2_files(pod, 2 * GB, anon=400 * MiB, active_file=800 * MiB, file_mapped=50 * MiB),
    }
    limit = memory_limit(make_tree(tmp_path, files), HOST)
    assert limit is not None and limit.limit == 2 * GB
    assert limit.headroom == 2 * GB - 450 * MiB


def test_v2_without_lru_fields_uses_file_less_shmem(tmp_path: Path) -> None:
    files = {**DOCKER_V2, "sys/fs/cgroup/memory.max": f"{GB}\n", "sys/fs/cgroup/memory.current": f"{600 * MiB}\n",
             "sys/fs/cgroup/memory.stat": f"anon {100 * MiB}\nfile {500 * MiB}\nshmem {50 * MiB}\n"}
    limit = memory_limit(make_tree(tmp_path, files), HOST)
    assert limit is not None and limit.headroom == GB - 150 * MiB


# --- damaged files -----------------------------------------------------------------------------


@pytest.mark.parametrize("stat", [
    "", "\0\0\0", "anon\nfile x\n", "active_file -5\n", "active_file 99999999999999999999999999\n",
    "inactive_file 1 2 3\n" * 1000, "\ufffd" * 10_000,
])
def test_damaged_memory_stat_never_makes_room_it_does_not_show(tmp_path: Path, stat: str) -> None:
    files = {**DOCKER_V2, "sys/fs/cgroup/memory.max": f"{GB}\n", "sys/fs/cgroup/memory.current": f"{300 * MiB}\n",
             "sys/fs/cgroup/memory.stat": stat}
    limit = memory_limit(make_tree(tmp_path, files), HOST)
    assert limit is not None and 0 <= limit.headroom <= GB


def test_memory_stat_that_is_a_folder_or_unreadable(tmp_path: Path) -> None:
    files = {**DOCKER_V2, "sys/fs/cgroup/memory.max": f"{GB}\n", "sys/fs/cgroup/memory.current": f"{300 * MiB}\n"}
    root = make_tree(tmp_path, files)
    (root / "sys/fs/cgroup/memory.stat").mkdir()
    limit = memory_limit(root, HOST)
    assert limit is not None and limit.headroom == GB - 300 * MiB  # nothing counted as reclaimable


def test_usage_over_the_limit_leaves_nothing(tmp_path: Path) -> None:
    files = {**DOCKER_V2, "sys/fs/cgroup/memory.max": f"{GB}\n", "sys/fs/cgroup/memory.current": f"{2 * GB}\n"}
    limit = memory_limit(make_tree(tmp_path, files), HOST)
    assert limit is not None and limit.headroom == 0


# --- the property: page cache nobody maps never costs budget ------------------------------------

sizes = st.integers(min_value=0, max_value=2**40)


@settings(max_examples=300, deadline=None)
@given(version=st.sampled_from([1, 2]), anon=sizes, kernel=sizes, shmem=sizes, mapped=sizes, dirty=sizes,
       writeback=sizes, clean=sizes, more_clean=sizes, active_share=st.floats(0, 1))
def test_unreclaimable_counts_every_unreclaimable_page_and_no_clean_cache(
        version: int, anon: int, kernel: int, shmem: int, mapped: int, dirty: int, writeback: int, clean: int,
        more_clean: int, active_share: float) -> None:
    """For any mix: at least anon + kernel + shmem + mapped + dirty + writeback stays used, never
    more than the usage, and more clean unmapped cache (a previous run's) changes nothing."""
    def stat_and_usage(cache: int) -> tuple[dict[str, int], int]:
        lru = mapped + dirty + writeback + cache
        active = int(lru * active_share)
        p = "total_" if version == 1 else ""
        names = (("mapped_file", "dirty", "writeback") if version == 1 else
                 ("file_mapped", "file_dirty", "file_writeback"))
        stat = {p + "active_file": active, p + "inactive_file": lru - active, p + "shmem": shmem,
                **{p + n: v for n, v in zip(names, (mapped, dirty, writeback), strict=True)}}
        return stat, anon + kernel + shmem + lru

    stat, usage = stat_and_usage(clean)
    used = unreclaimable(version, usage, stat)
    assert anon + kernel + shmem + mapped + dirty + writeback <= used <= usage
    assert unreclaimable(version, *reversed(stat_and_usage(clean + more_clean))) == used


# --- real cgroups --------------------------------------------------------------------------------

# What probes in two processes may differ by with nothing changed: the kernel charges and flushes
# memory.stat in batches of 64 pages per CPU (MEMCG_CHARGE_BATCH), so usage and each stat field can
# each be off by 256 KiB per CPU; the probing interpreter's own heap varies by a few hundred KiB;
# and cgroup v1 cannot split off the page cache's index nodes (slab, ~0.3 % of the cached bytes),
# which the previous run leaves charged. Measured here: 64 KiB to 0.8 MiB.
def tolerance(cached: int) -> int:
    return 4 * MiB + 2 * 256 * 1024 * (os.cpu_count() or 1) + cached // 100


PROBE = textwrap.dedent("""
    import json, mmap, sys
    from gguf_mcv import hardware
    from gguf_mcv.planning.planner import resolve_budget
    hardware._llama_gpu_offload = lambda: (False, "not asked")  # the GPU build is no memory fact

    def probe():
        hw = hardware.probe()
        return {"available": hw.available_ram, "budget": resolve_budget(hw, None)[0],
                "total": hw.total_ram, "source": hw.memory_limit_source}

    steps, out = json.loads(sys.argv[1]), {"first": probe()}
    if "read" in steps:  # twice: the second read makes the pages active
        for _ in range(2):
            with open(steps["read"], "rb") as f:
                while f.read(1 << 20):
                    pass
    if "map" in steps:
        f = open(steps["read"], "rb")
        m = mmap.mmap(f.fileno(), steps["map"], prot=mmap.PROT_READ)
        sum(m[i] for i in range(0, steps["map"], 4096))
        out["mapped"] = probe()
    if "shm" in steps:
        with open(steps["shm"], "wb") as f:
            f.write(b"x" * steps["shm_bytes"])
    print(json.dumps(out), flush=True)
    if steps.get("hold"):
        sys.stdin.read()  # until the test closes stdin
""")


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GGUF_MCV_HW_ROOT"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
    return env


def run_probe(group: MemoryCgroup, **steps: object) -> dict[str, dict[str, int]]:
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(steps)], preexec_fn=group.join,
                          env=_child_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.fixture
def make_cgroup() -> Iterator[Callable[..., MemoryCgroup]]:
    """``make_cgroup(limit, parent=None)``: a real memory cgroup, removed after the test (its
    processes moved out first), however the test ends; skips where none can be made."""
    if not sys.platform.startswith("linux"):
        pytest.skip("memory cgroups are Linux's")
    made: list[MemoryCgroup] = []

    def make(limit: int | None, parent: MemoryCgroup | None = None) -> MemoryCgroup:
        try:
            group = MemoryCgroup.make(limit, parent, prefix="gguf_mcv_test")
        except OSError as exc:
            pytest.skip(f"no memory cgroup can be made here ({exc}); these tests need root and a "
                        "cgroup v1 or v2 memory controller")
        made.append(group)
        return group

    yield make
    for group in reversed(made):  # children first
        group.remove()
    assert not any(g.folder.exists() for g in made)


@pytest.fixture
def uncached_file(tmp_path: Path) -> Iterator[Path]:
    """A 192 MiB file on disk whose pages are in no page cache (so the cgroup that reads them is
    charged for them)."""
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        block = os.urandom(MiB)
        for _ in range(192):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    yield path


def _file_cache(group: MemoryCgroup) -> int:
    st = group.stat()
    p = "total_" if group.version == 1 else ""
    return st.get(p + "active_file", 0) + st.get(p + "inactive_file", 0)


def test_real_second_run_plans_like_the_first(make_cgroup, uncached_file: Path) -> None:
    group = make_cgroup(768 * MiB)
    first = run_probe(group, read=str(uncached_file), map=64 * MiB)
    cached = _file_cache(group)
    assert cached >= 150 * MiB, "the first run's page cache should stay charged to the cgroup"
    second = run_probe(group)
    tol = tolerance(cached)
    assert first["first"]["source"] == second["first"]["source"] is not None
    assert abs(second["first"]["available"] - first["first"]["available"]) <= tol
    assert abs(second["first"]["budget"] - first["first"]["budget"]) <= tol
    # while the first run mapped 64 MiB of the file, those pages were used
    assert first["mapped"]["available"] <= first["first"]["available"] - 64 * MiB + tol
    assert group.oom_kills() in (0, None)


def test_real_pages_mapped_by_a_live_process_are_used(make_cgroup, uncached_file: Path) -> None:
    group = make_cgroup(768 * MiB)
    before = run_probe(group)["first"]
    holder = subprocess.Popen([sys.executable, "-c", PROBE, json.dumps({"read": str(uncached_file),
                               "map": 96 * MiB, "hold": True})], preexec_fn=group.join, env=_child_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline()  # mapped and holding
        during = run_probe(group)["first"]
    finally:
        holder.communicate("", timeout=600)
    after = run_probe(group)["first"]
    tol = tolerance(_file_cache(group))
    assert during["available"] <= before["available"] - 96 * MiB + tol
    assert abs(after["available"] - before["available"]) <= tol  # unmapped again: reclaimable


def test_real_shmem_left_behind_is_used(make_cgroup, tmp_path: Path) -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    group = make_cgroup(768 * MiB)
    shm = Path("/dev/shm") / f"gguf_mcv_test_{os.getpid()}_{tmp_path.name}"
    try:
        first = run_probe(group, shm=str(shm), shm_bytes=96 * MiB)["first"]
        second = run_probe(group)["first"]
    finally:
        shm.unlink(missing_ok=True)
    assert second["available"] <= first["available"] - 96 * MiB + tolerance(0)


def test_real_nested_parent_limit_binds(make_cgroup) -> None:
    pod = make_cgroup(512 * MiB)
    ctr, sidecar = make_cgroup(2048 * MiB, pod), make_cgroup(None, pod)
    shm = Path("/dev/shm") / f"gguf_mcv_test_{os.getpid()}_sidecar"
    try:
        alone = run_probe(ctr)["first"]
        run_probe(sidecar, shm=str(shm), shm_bytes=64 * MiB)  # the sidecar's charge stays with the pod
        beside = run_probe(ctr)["first"]
    finally:
        shm.unlink(missing_ok=True)
    assert alone["total"] == 512 * MiB
    assert 512 * MiB - 100 * MiB < alone["available"] <= 512 * MiB
    assert beside["available"] <= alone["available"] - 64 * MiB + tolerance(0)


MODEL_CHILD = textwrap.dedent("""
    import json, sys
    import PIL.Image
    import gguf_mcv
    from gguf_mcv.errors import NoQuantFitsError
    from gguf_mcv.resolver import plan_local

    model, mmproj, image = sys.argv[1:4]
    PIL.Image.new("RGB", (448, 448), (120, 40, 200)).save(image)
    plan = plan_local(model, mmproj)
    try:
        with gguf_mcv.load(model_path=model, mmproj_path=mmproj, n_threads=2) as m:
            reply = m.ask("What is this?", image, max_tokens=4, temperature=0.0)
    except NoQuantFitsError as exc:
        print(json.dumps({"refused": str(exc), "budget": plan.budget}), flush=True)
        sys.exit(3)
    print(json.dumps({"budget": plan.budget, "needed": plan.predicted_bytes,
                      "tokens": reply.usage.completion_tokens}), flush=True)
""")


def _write_back(folder: Path) -> None:
    """Write the files under ``folder`` to disk, as the kernel does within 30 s
    (``vm.dirty_expire_centisecs``): dirty pages count as used until then."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def test_real_model_loads_twice_in_a_cgroup_with_the_probes_budget(make_cgroup, tiny, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """First and second run in one cgroup sized to the model, the budget left to the probe: both
    plan and answer, the second with the first's budget, and nobody is OOM-killed."""
    from gguf_mcv import hardware
    from gguf_mcv.resolver import plan_local

    cache = tmp_path / "cache"
    monkeypatch.setenv("GGUF_MCV_CACHE", str(cache))  # the first run converts the encoder
    model, mmproj = tiny.quants["Q4_K_M"], tiny.mmproj
    needed = plan_local(model, mmproj, ram_budget="64GB").predicted_bytes
    # the model's needs, the container reserve, and 48 MiB for what the probing process already uses
    group = make_cgroup(needed + hardware.CONTAINER_RESERVE + 48 * MiB)
    for path in (model, mmproj):  # uncached, so the cgroup is charged for the model's pages
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    runs = []
    for n in range(2):
        done = subprocess.run([sys.executable, "-c", MODEL_CHILD, str(model), str(mmproj),
                               str(tmp_path / f"image{n}.png")], preexec_fn=group.join, env=_child_env(),
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, (done.returncode, done.stdout[-1000:], done.stderr[-3000:])
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        assert group.oom_kills() in (0, None)
        _write_back(cache)
    first, second = runs
    assert first["needed"] == second["needed"] == needed <= min(first["budget"], second["budget"])
    assert first["tokens"] > 0 and second["tokens"] > 0
    assert abs(second["budget"] - first["budget"]) <= tolerance(_file_cache(group))
