"""The package's import graph runs one way: no cycles (imports inside functions count), and
the layers a request passes through only import the layers below them."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gguf_mcv"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Package modules ``path`` imports anywhere (``if TYPE_CHECKING:`` blocks excluded)."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        up = node
        while up in parents:
            up = parents[up]
            if isinstance(up, ast.If) and "TYPE_CHECKING" in ast.unparse(up.test):
                break
        else:
            names: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    root = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(root + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                names = [a.name for a in node.names]
            for name in names:
                while name and name not in modules and "." in name:
                    name = name.rpartition(".")[0]
                if name in modules and name != here:
                    found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    # a package's __init__ only re-exports; an edge into it stands for "the package"
    return {m: {t for t in _imports(p, modules) if not paths[t].name == "__init__.py"}
            for m, p in paths.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_nothing_below_the_cli_and_server_imports_them() -> None:
    top = ("gguf_mcv.cli", "gguf_mcv.__main__", "gguf_mcv.server", "gguf_mcv.fleet")
    for module, targets in _graph().items():
        if module.startswith(top):
            continue
        assert not {t for t in targets if t.startswith(top)}, module


def test_the_request_path_runs_one_way() -> None:
    graph = _graph()
    forbidden = {
        # the planner is pure: it chooses, it fetches nothing
        "gguf_mcv.planning.planner": {"gguf_mcv.models.hub", "gguf_mcv.resolver", "gguf_mcv.models.catalog",
                                      "gguf_mcv.loader"},
        # the Hub layer lists and fetches files; it knows no model names and plans nothing
        "gguf_mcv.models.hub": {"gguf_mcv.planning.planner", "gguf_mcv.models.catalog", "gguf_mcv.resolver",
                                "gguf_mcv.loader"},
        "gguf_mcv.resolver": {"gguf_mcv.loader", "gguf_mcv.model", "gguf_mcv.runtime.engine"},
        "gguf_mcv.planning.memory": {"gguf_mcv.planning.planner", "gguf_mcv.models.catalog", "gguf_mcv.models.hub"},
        "gguf_mcv.runtime.engine": {"gguf_mcv.model", "gguf_mcv.loader", "gguf_mcv.prompt.turns"},
        "gguf_mcv.prompt.turns": {"gguf_mcv.model", "gguf_mcv.loader", "gguf_mcv.prompt.messages"},
    }
    for module, banned in forbidden.items():
        assert not graph[module] & banned, (module, graph[module] & banned)


def test_loader_reaches_the_hub_only_through_the_resolver() -> None:
    graph = _graph()
    assert "gguf_mcv.resolver" in graph["gguf_mcv.loader"]
    assert "gguf_mcv.models.hub" not in graph["gguf_mcv.loader"]


def test_import_gguf_mcv_stays_light() -> None:
    """``import gguf_mcv`` loads neither OpenCV nor llama.cpp's native library; they load on first use."""
    code = "import sys, gguf_mcv; print(sorted(m for m in ('cv2', 'llama_cpp') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


#: The package's layers, lowest first: a module imports only from its own layer and those before it
#: (so no path, however indirect, leads back up: the planner never reaches llama.cpp's runtime).
LAYERS: list[tuple[str, set[str]]] = [
    ("values", {"errors", "environment", "units", "options", "reply", "cache_files", "progress", "cgroups", "hardware",
                "native_verdict", "children", "llama_log",
                "bytes_cache"}),
    ("generations", {"generations"}),
    ("models", {"models"}),
    ("vision", {"vision"}),
    ("planning", {"planning"}),
    ("output", {"output"}),
    ("prompt", {"prompt"}),
    ("testing", {"testing"}),
    ("runtime", {"runtime"}),
    ("api", {"model", "chat", "questions", "openai_compat", "loader", "resolver", "chat_handler", "selftest"}),
    ("jobs", {"jobs"}),
    ("watch", {"watch"}),
    ("server", {"server"}),
    ("fleet", {"fleet"}),
    ("command", {"cli", "__main__", ""}),
]


def _layer(module: str) -> int:
    name = module.split(".")[1] if "." in module else ""
    for i, (_, members) in enumerate(LAYERS):
        if name in members:
            return i
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")


def test_every_import_points_down_the_layers() -> None:
    upward = [f"{m} -> {t}" for m, targets in _graph().items() for t in targets if _layer(t) > _layer(m)]
    assert upward == []


def test_planning_reaches_neither_the_runtime_nor_the_vision_encoders_files_through_anything() -> None:
    graph = _graph()
    seen: set[str] = set()
    todo = [m for m in graph if m.startswith("gguf_mcv.planning.")]
    while todo:
        m = todo.pop()
        for t in graph[m] - seen:
            seen.add(t)
            todo.append(t)
    assert not {m for m in seen if m.startswith(("gguf_mcv.runtime.", "gguf_mcv.testing."))}, seen


def test_each_question_has_one_folder() -> None:
    """Where to change the vision encoder, the quant choice, the HTTP API or the prompt."""
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert {"vision", "planning", "server", "prompt"} <= folders
    assert (PACKAGE / "vision" / "onnx_vision.py").is_file() and (PACKAGE / "planning" / "planner.py").is_file()


#: Modules that read or write the world; the planner takes the machine's facts as values instead.
IO_MODULES = {"os", "io", "platform", "subprocess", "pathlib", "psutil", "shutil", "socket", "urllib",
              "requests", "httpx", "huggingface_hub", "llama_cpp", "gguf", "ctypes"}
#: Package modules that do I/O (probe the machine, read files, run checks): planning must not import them.
IO_PACKAGE_MODULES = {"gguf_mcv.native_verdict", "gguf_mcv.resolver", "gguf_mcv.runtime",
                      "gguf_mcv.models.headers", "gguf_mcv.models.hub", "gguf_mcv.environment", "gguf_mcv.cgroups"}


#: What planning/ may take from gguf_mcv.hardware: the snapshot's types, constants and pure functions.
PURE_HARDWARE_NAMES = {"Hardware", "Gpu", "cpu_family", "OS_RESERVE_FRACTION", "OS_RESERVE_MIN"}


def test_planning_does_no_io() -> None:
    """planning/ is pure: no I/O library, no I/O module of ours (function-level imports count), no open()."""
    graph = _graph()
    for path in sorted((PACKAGE / "planning").glob("*.py")):
        tree = ast.parse(path.read_text())
        stdlib = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                  for alias in node.names}
        stdlib |= {node.module.split(".")[0] for node in ast.walk(tree)
                   if isinstance(node, ast.ImportFrom) and node.module and not node.level}
        assert not stdlib & IO_MODULES, f"{path.name} imports {sorted(stdlib & IO_MODULES)}"
        ours = {m for m in graph[_module_name(path)]
                if any(m == io or m.startswith(io + ".") for io in IO_PACKAGE_MODULES)}
        assert not ours, f"{path.name} imports {sorted(ours)}"
        from_hardware = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "hardware"
                         and n.level == 2 for a in n.names}
        # the machine's facts come in as a Hardware value; hardware's probes are not the planner's to call
        assert from_hardware <= PURE_HARDWARE_NAMES, f"{path.name} imports {sorted(from_hardware - PURE_HARDWARE_NAMES)}"
        opens = [n.lineno for n in ast.walk(tree)
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "open"]
        assert not opens, f"{path.name} calls open() at lines {opens}"


def test_the_public_names_are_exported_and_every_error_is_one() -> None:
    import inspect

    import gguf_mcv
    from gguf_mcv import errors

    assert [n for n in gguf_mcv.__all__ if not hasattr(gguf_mcv, n)] == []
    ours = [name for name, cls in vars(errors).items() if inspect.isclass(cls)
            and issubclass(cls, errors.GgufMcvError) and cls.__module__ == errors.__name__]
    assert [n for n in ours if n not in gguf_mcv.__all__] == []  # an error a user may catch is importable
    assert gguf_mcv.batch.run is not None and gguf_mcv.watch is not None  # both job kinds, by module or function


def test_one_module_of_the_package_does_not_import_the_rest_and_watch_stays_the_function() -> None:
    """What the package's own children rely on: importing the native check does not load the
    answering stack (``gguf_mcv/__init__`` is lazy); importing the ``gguf_mcv.watch``
    subpackage first does not hide the ``gguf_mcv.watch`` function."""
    child = ("import sys, inspect\n"
             "import gguf_mcv.runtime.native_check\n"
             "print(sorted(m for m in ('gguf_mcv.chat', 'gguf_mcv.model', 'gguf_mcv.loader') if m in sys.modules))\n"
             "import gguf_mcv.watch.sources, gguf_mcv\n"
             "print(inspect.isfunction(gguf_mcv.watch), gguf_mcv.watch is sys.modules['gguf_mcv.watch.observe'].watch)\n")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["[]", "True True"], out.stdout
