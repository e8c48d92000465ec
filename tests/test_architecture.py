"""Import-layering guard: fails when a forbidden import appears between the project's modules.

parallel/ and planner/ stay model-agnostic (they move tensor dicts and plan work; they never reach
models/ or a role such as trainer or runtime), and models/ know nothing of ranks (no torch.distributed,
no roles, no parallel/ or planner/). rewards/ sit beside models/ and likewise import no role and no
distributed machinery. The graph has no cycles, and imports sit at module top level except where
listed in ALLOWED_IN_FUNCTIONS, so every dependency is visible here. Pure `ast` + file system: fast.
The checkers take a root and return violations; test_checker_can_fail runs them on a fake project.
"""
from __future__ import annotations

import ast
import importlib.util
import io
import re
import subprocess
import tokenize
from collections import deque
from pathlib import Path

from parallel import store_keys

from rl import algorithms

ROOT = Path(__file__).resolve().parent.parent
ROOT_MODULES = {"train_disagg", "rollout", "trainer"}
"""the only modules at the root: the entry and the two roles (docs/architecture.md)"""
ROLES = {"train_disagg", "rollout", "trainer"}
LAYERS = [("lab",), ("train_disagg",), ("runtime",), ("rollout", "trainer"), ("config",),
          ("checkpointing", "prompts", "planner"), ("parallel",), ("models", "rewards"), ("rl", "telemetry")]
"""top to bottom: a package (or root module) imports only its own layer's or lower ones; the lab
(offline tools) sits above the run, so nothing of the run imports it"""
MODEL_AGNOSTIC = ("parallel", "planner", "lab.planning")
"""packages that never reach models/, a role or runtime/ (they run without torch models)"""
MAX_RUNTIME_FUNCTION_LINES = 80
REGISTRY = "rl/algorithms/__init__.py"
"""the algorithms' registry, which names every algorithm"""
NAMED_OTHERWISE = {
    ("rl/loss.py", "flow_grpo"): "--kl-form flow_grpo: the KL term named after Flow-GRPO's formula, a value recipes "
                                 "and config.json files hold",
    **{(f, "flow_grpo"): "the reward protocol of Flow-GRPO's reward servers (flow_grpo+http://HOST:PORT/NAME, "
                         "--protocol flow_grpo), a value reward specs hold"
       for f in ("rewards/pickle_wire.py", "rewards/remote.py", "rewards/server.py", "scripts/reward_server.py",
                 "config/schema.py")},
}
"""(file, word): an algorithm's name used for something else"""

# Function-level imports allowed. A key ending in ".py" exempts every function-level import in that
# file; any other key is the top-level name of an optional dependency (modules not importable in this
# venv count as optional too).
ALLOWED_IN_FUNCTIONS = {
    "models/__init__.py": "family registry: a family is imported on first use, its import cost paid only then",
    "rewards/__init__.py": "reward registry: a reward (CLIP, OCR, ...) is imported on first use",
    "rewards/reward.py": "reward registry helpers: scorer modules and weights are loaded on first use",
    "flash_attn": "optional attention backend, not installed everywhere",
    "sageattention": "optional attention backend, not installed everywhere",
    "wandb": "optional logging (--wandb), imported only by a run that asks for it; CI installs it (requirements.lock)",
}


def _in(module: str, pkg: str) -> bool:
    return module == pkg or module.startswith(pkg + ".")


def _sources(root: Path) -> dict[str, Path]:
    """Module name -> relative path of every tracked project .py file (tests/ and scripts/ left out)."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "*.py"], capture_output=True, text=True, check=True)
    mods = {}
    for rel in out.stdout.split():
        path = Path(rel)
        if path.parts[0] in ("tests", "scripts") or not (root / path).is_file():
            continue
        parts = list(path.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _imports(root: Path):
    """Yield (module, path, statement, imported name, project module or None, inside a function) per name."""
    mods = _sources(root)

    def project(name: str):
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in mods:
                return ".".join(parts[:n])
        return None

    for mod, path in sorted(mods.items()):
        tree = ast.parse((root / path).read_text(), filename=str(path))
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]

        def visit(node, in_func):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.Import):
                    for a in child.names:
                        yield mod, path, child, a.name, project(a.name), in_func
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:  # relative: drop level-1 trailing parts of the package
                        up = pkg.split(".")[: len(pkg.split(".")) - child.level + 1] if pkg else []
                        base = ".".join(up + [base] if base else up)
                    for a in child.names:
                        name = f"{base}.{a.name}" if base else a.name
                        yield mod, path, child, name, project(name), in_func
                scope = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                yield from visit(child, scope or (in_func and not isinstance(child, ast.ClassDef)))

        yield from visit(tree, False)


def _graph(root: Path) -> dict[str, set[str]]:
    graph = {m: set() for m in _sources(root)}
    for mod, _, _, _, dep, _ in _imports(root):
        if dep and dep != mod:
            graph[mod].add(dep)
    return graph


def _bfs(graph: dict[str, set[str]], src: str, stop=lambda m: False) -> dict[str, str | None]:
    """Breadth-first parents of every module `src` reaches, not walking past modules where `stop`."""
    prev, queue = {src: None}, deque([src])
    while queue:
        v = queue.popleft()
        for w in () if stop(v) else sorted(graph[v]):
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return prev


def find_cycles(root: Path) -> list[list[str]]:
    """Strongly connected components of more than one module."""
    graph = _graph(root)
    reach = {v: _bfs(graph, v) for v in graph}
    sccs = {tuple(sorted(w for w in reach[v] if v in reach[w])) for v in graph}
    return sorted(list(scc) for scc in sccs if len(scc) > 1)


def find_leaks(root: Path) -> list[list[str]]:
    """Shortest chain from each parallel/planner module to each models or role module it reaches
    (not walking past the first such module)."""
    graph, leaks = _graph(root), []
    bad = lambda m: _in(m, "models") or m in ROLES or _in(m, "runtime")
    for src in sorted(m for m in graph if any(_in(m, p) for p in MODEL_AGNOSTIC)):
        prev = _bfs(graph, src, bad)
        for v in sorted(filter(bad, prev)):
            chain = [v]
            while prev[chain[-1]]:
                chain.append(prev[chain[-1]])
            leaks.append(chain[::-1])
    return leaks


def find_bad_imports(root: Path, owner: str) -> list[str]:
    """Direct imports from `owner` (models or rewards) of a role or parallel/planner, and for models
    of torch.distributed."""
    out = []
    for mod, path, stmt, name, dep, _ in _imports(root):
        dist = owner == "models" and _in(name, "torch.distributed")
        if _in(mod, owner) and (dist or dep in ROLES or _in(dep or "", "parallel") or _in(dep or "", "planner")):
            out.append(f"{path}:{stmt.lineno} {mod} -> {dep or 'torch.distributed'}")
    return list(dict.fromkeys(out))


def find_function_imports(root: Path) -> list[str]:
    """Import statements inside a def (nearest scope), save those ALLOWED_IN_FUNCTIONS covers."""
    out = []
    for _, path, stmt, name, dep, in_func in _imports(root):
        top = name.split(".")[0]
        if not in_func or path.as_posix() in ALLOWED_IN_FUNCTIONS:
            continue
        if dep is None and (top in ALLOWED_IN_FUNCTIONS or importlib.util.find_spec(top) is None):
            continue
        out.append(f"{path}:{stmt.lineno} {ast.unparse(stmt)}")
    return list(dict.fromkeys(out))


def _top(module: str) -> str:
    return module.split(".")[0]


def find_folder_cycles(root: Path) -> list[list[str]]:
    """Cycles between packages (and root modules): a folder imports another that imports it back."""
    graph: dict[str, set[str]] = {}
    for mod, deps in _graph(root).items():
        graph.setdefault(_top(mod), set()).update(_top(d) for d in deps if _top(d) != _top(mod))
    for deps in list(graph.values()):
        for d in deps:
            graph.setdefault(d, set())
    reach = {v: _bfs(graph, v) for v in graph}
    sccs = {tuple(sorted(w for w in reach[v] if v in reach[w])) for v in graph}
    return sorted(list(scc) for scc in sccs if len(scc) > 1)


def find_layer_breaks(root: Path, layers=LAYERS) -> list[str]:
    """Imports of a higher layer (LAYERS), and packages that belong to no layer."""
    rank = {name: i for i, layer in enumerate(layers) for name in layer}
    out = []
    for mod, path, stmt, name, dep, _ in _imports(root):
        if dep is None or _top(dep) == _top(mod):
            continue
        a, b = rank.get(_top(mod)), rank.get(_top(dep))
        if a is None or b is None:
            out.append(f"{path}:{stmt.lineno} {mod} -> {dep}: {_top(mod) if a is None else _top(dep)} is in no layer")
        elif b < a:
            out.append(f"{path}:{stmt.lineno} {mod} -> {dep}: imports a higher layer")
    return list(dict.fromkeys(out))


def find_root_modules(root: Path, allowed=ROOT_MODULES) -> list[str]:
    """Modules at the root besides the entry and the roles."""
    return sorted(str(p) for m, p in _sources(root).items() if "." not in m and p.parent == Path(".")
                  and p.name != "__init__.py" and m not in allowed)


def find_long_functions(root: Path, package: str = "runtime", limit: int = MAX_RUNTIME_FUNCTION_LINES) -> list[str]:
    """Functions of `package` longer than `limit` lines (the step loop and the rank's build read
    on one screen)."""
    out = []
    for mod, path in sorted(_sources(root).items()):
        if not _in(mod, package):
            continue
        for node in ast.walk(ast.parse((root / path).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path}:{node.lineno} {node.name} is {n} lines")
    return out


def find_sys_path_edits(root: Path) -> list[str]:
    """Any use of sys.path in a tracked Python file (scripts run as `python -m scripts.NAME`, tests
    import through pytest's configuration)."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "*.py"], capture_output=True, text=True, check=True)
    hits = []
    for rel in out.stdout.split():
        if not (root / rel).is_file():
            continue
        for node in ast.walk(ast.parse((root / rel).read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
                    and node.value.id == "sys":
                hits.append(f"{rel}:{node.lineno}")
    return hits


def find_lab_in_the_run(root: Path, entry: str = "train_disagg") -> list[str]:
    """Chains from the run's entry to a module of the lab (lab/) or of scripts/, through every import
    (function-level ones included: the registries' families and rewards are part of the run)."""
    mods = _sources(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, _, _, name, dep, _ in _imports(root):
        if dep and dep != mod:
            graph[mod].add(dep)
    for mod in mods:  # a package's modules named in strings of its registry ("models.flux:FluxAdapter")
        text = (root / mods[mod]).read_text()
        for other in mods:
            if other.count(".") == 1 and _in(other, mod) and f'"{other}:' in text:
                graph[mod].add(other)
    prev = _bfs(graph, entry)
    out = []
    for v in sorted(m for m in prev if _in(m, "lab") or _in(m, "scripts")):
        chain = [v]
        while prev[chain[-1]]:
            chain.append(prev[chain[-1]])
        out.append(" -> ".join(chain[::-1]))
    return out


def find_duplicate_basenames(root: Path) -> list[str]:
    """Tracked Python files outside tests/ that share a file name (`__init__.py` aside): a name says
    what one file holds."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "*.py"], capture_output=True, text=True, check=True)
    seen: dict[str, list[str]] = {}
    for rel in out.stdout.split():
        path = Path(rel)
        if path.parts[0] != "tests" and path.name != "__init__.py":
            seen.setdefault(path.name, []).append(rel)
    return sorted(", ".join(sorted(paths)) for paths in seen.values() if len(paths) > 1)


def own_algorithm_files(registry=algorithms) -> dict[str, set[str]]:
    """File -> the algorithm names (and old spellings) it may hold: each algorithm's own file, the registry all."""
    out: dict[str, set[str]] = {REGISTRY: set(registry.ALGORITHMS) | set(registry.ALIASES)}
    for name, a in registry.ALGORITHMS.items():
        path = type(a).__module__.replace(".", "/") + ".py"
        out.setdefault(path, set()).update({name} | {old for old, new in registry.ALIASES.items() if new == name})
    return out


def find_algorithm_names(root: Path, names, aliases, own: dict[str, set[str]],
                         otherwise=NAMED_OTHERWISE) -> list[str]:
    """An algorithm's name outside its own file, the registry and tests/: as an identifier, or as a
    word of a string (a path's component aside: the recipes' folders, a peer's OWNER/REPOSITORY). An
    old spelling that is an ordinary word ("window") counts where a string names it as the algorithm
    (`--algorithm window`, `algorithm = "window"`). Docs and recipes are not Python: they may name them."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "*.py"], capture_output=True, text=True, check=True)
    words = {n: re.compile(rf"(?<![\w/]){re.escape(n)}(?![\w/])") for n in names}
    as_algorithm = {a: re.compile(rf"algorithm\W{{1,4}}{re.escape(a)}(?!\w)") for a in aliases}
    strings = {tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    hits = []
    for rel in out.stdout.split():
        if rel.startswith("tests/") or not (root / rel).is_file():
            continue
        mine = own.get(rel, set())
        for tok in tokenize.generate_tokens(io.StringIO((root / rel).read_text()).readline):
            if tok.type == tokenize.NAME:
                found = {tok.string} & set(names)
            elif tok.type in strings:
                found = {n for n, w in words.items() if w.search(tok.string)}
                found |= {a for a, w in as_algorithm.items() if w.search(tok.string)}
            else:
                continue
            hits += [f"{rel}:{tok.start[0]} {n}" for n in sorted(found - mine) if (rel, n) not in otherwise]
    return list(dict.fromkeys(hits))


def find_store_key_literals(root: Path, families=store_keys.FAMILIES) -> list[str]:
    """String constants of the run's code that start like a store key (`FAMILY/`) outside the
    registry of keys (parallel/store_keys.py): a key written around the registry."""
    pattern = re.compile(rf"^({'|'.join(families)})/")
    out = []
    for mod, path in sorted(_sources(root).items()):
        if _in(mod, "lab") or path.as_posix() == "parallel/store_keys.py":
            continue
        for node in ast.walk(ast.parse((root / path).read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.match(node.value):
                out.append(f"{path}:{node.lineno} {node.value!r}")
    return out


def _lines(items) -> str:
    return "\n  " + "\n  ".join(items)


def test_no_import_cycles():
    cycles = find_cycles(ROOT)
    assert not cycles, "import cycles (modules of each):" + _lines(", ".join(c) for c in cycles)


def test_parallel_and_planner_stay_model_agnostic():
    leaks = find_leaks(ROOT)
    assert not leaks, "parallel/planner reach models or a role:" + _lines(" -> ".join(chain) for chain in leaks)


def test_models_know_nothing_of_ranks():
    bad = find_bad_imports(ROOT, "models")
    assert not bad, "models import torch.distributed, a role, parallel or planner:" + _lines(bad)


def test_rewards_import_no_role_or_parallel():
    bad = find_bad_imports(ROOT, "rewards")
    assert not bad, "rewards import a role, parallel or planner:" + _lines(bad)


def test_no_imports_in_functions():
    bad = find_function_imports(ROOT)
    assert not bad, "imports inside functions (move to top level, or allow in ALLOWED_IN_FUNCTIONS):" + _lines(bad)


def test_no_folder_cycles():
    cycles = find_folder_cycles(ROOT)
    assert not cycles, "packages that import each other:" + _lines(", ".join(c) for c in cycles)


def test_layers_import_only_downward():
    bad = find_layer_breaks(ROOT)
    assert not bad, "imports against the layers of docs/architecture.md:" + _lines(bad)


def test_the_root_holds_only_the_entry_and_the_roles():
    extra = find_root_modules(ROOT)
    assert not extra, f"modules at the root besides {sorted(ROOT_MODULES)}:" + _lines(extra)


def test_runtime_functions_fit_on_a_screen():
    long = find_long_functions(ROOT)
    assert not long, f"runtime/ functions over {MAX_RUNTIME_FUNCTION_LINES} lines:" + _lines(long)


def test_nothing_patches_sys_path():
    hits = find_sys_path_edits(ROOT)
    assert not hits, "sys.path used (run scripts with python -m scripts.NAME):" + _lines(hits)


def test_the_run_never_imports_the_lab():
    chains = find_lab_in_the_run(ROOT)
    assert not chains, "the run imports the lab or a script:" + _lines(chains)


def test_no_two_files_share_a_name():
    dups = find_duplicate_basenames(ROOT)
    assert not dups, "files with the same name (rename one to say what it holds):" + _lines(dups)


def test_no_algorithm_name_outside_its_file():
    """Roles and mechanisms call an algorithm's methods (rl/algorithms/algorithm.py); none asks which
    algorithm runs, so a new algorithm is its file and one line of the registry."""
    hits = find_algorithm_names(ROOT, list(algorithms.ALGORITHMS), list(algorithms.ALIASES), own_algorithm_files())
    assert not hits, "an algorithm named outside its own file (rl/algorithms/NAME.py) and the registry:" + _lines(hits)


def test_store_keys_come_from_their_registry():
    bad = find_store_key_literals(ROOT)
    assert not bad, "store keys written outside parallel/store_keys.py:" + _lines(bad)


def test_checker_can_fail(tmp_path):
    files = {
        "parallel/__init__.py": "",
        "parallel/a.py": "import models.b\n",
        "planner/p.py": "from .q import Z\n",
        "planner/q.py": "from typing import TYPE_CHECKING\nZ = 1\nif TYPE_CHECKING:\n    from models import m\n",
        "models/__init__.py": "def load():\n    import json\n",
        "models/b.py": "import importlib\n\ndef f():\n    return importlib.import_module('json')\n",
        "models/m.py": "import torch.distributed as dist\n",
        "models/n.py": "from torch import distributed\nfrom . import m\n",
        "trainer.py": "",
        "x.py": "import y\n",
        "y.py": "from x import thing\n",
        "rewards/r.py": "import trainer\n\ndef f():\n    import json\n    import flash_attn\n"
                        "    import no_such_module_xyz\n    class K:\n        import os\n",  # class scope: allowed
        "scripts/s.py": "def f():\n    import x\n",
        "train_disagg.py": "import runtime.r\n",
        "runtime/r.py": "def f():\n    import lab.tool\n",
        "lab/tool.py": "",
        "lab/planning/x.py": "import trainer\n",
        "lab/r.py": "",
        "rl/algorithms/alpha.py": "NAME = 'alpha'  # its own file\nOTHER = 'beta'\n",
        "rl/sampler.py": "def f(alpha):\n    return alpha_beta, 'recipes/alpha/x.toml', \"use --algorithm old\"\n",
        "rl/loss.py": "FORMS = ('alpha', 'old')  # a value named after it, and an ordinary word\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "add", "-A"], check=True)
    assert find_lab_in_the_run(tmp_path) == ["train_disagg -> runtime.r -> lab.tool"]
    (tmp_path / "runtime/k.py").write_text("def f(store, s):\n    store.put(f'claim/{s}', 1)\n    store.put('claim/x', 1)\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "-A"], check=True)
    assert find_store_key_literals(tmp_path, ("claim",)) == ["runtime/k.py:3 'claim/x'", "runtime/k.py:2 'claim/'"]
    (tmp_path / "runtime/k.py").unlink()
    subprocess.run(["git", "-C", str(tmp_path), "add", "-A"], check=True)
    own = {"rl/algorithms/alpha.py": {"alpha", "old"}}
    assert find_algorithm_names(tmp_path, ["alpha", "beta"], ["old"], own, {("rl/loss.py", "alpha"): ""}) == [
        "rl/algorithms/alpha.py:2 beta", "rl/sampler.py:1 alpha", "rl/sampler.py:2 old"]
    assert find_duplicate_basenames(tmp_path) == ["lab/planning/x.py, x.py", "lab/r.py, rewards/r.py, runtime/r.py"]
    assert find_cycles(tmp_path) == [["x", "y"]]
    assert find_leaks(tmp_path) == [["lab.planning.x", "trainer"], ["parallel.a", "models.b"],
                                    ["planner.p", "planner.q", "models.m"], ["planner.q", "models.m"]]
    assert find_bad_imports(tmp_path, "models") == ["models/m.py:1 models.m -> torch.distributed",
                                                    "models/n.py:1 models.n -> torch.distributed"]
    assert find_bad_imports(tmp_path, "rewards") == ["rewards/r.py:1 rewards.r -> trainer"]
    assert find_function_imports(tmp_path) == ["rewards/r.py:4 import json", "runtime/r.py:2 import lab.tool"]
    assert find_folder_cycles(tmp_path) == [["x", "y"]]
    assert find_root_modules(tmp_path) == ["x.py", "y.py"]
    assert find_layer_breaks(tmp_path, [("lab",), ("train_disagg",), ("runtime",), ("trainer",),
                                                  ("rewards", "models"), ("parallel",), ("planner",)]) == [
        "parallel/a.py:1 parallel.a -> models.b: imports a higher layer",
        "planner/q.py:4 planner.q -> models.m: imports a higher layer",
        "rewards/r.py:1 rewards.r -> trainer: imports a higher layer",
        "runtime/r.py:2 runtime.r -> lab.tool: imports a higher layer",
        "x.py:1 x -> y: x is in no layer", "y.py:1 y -> x: y is in no layer"]
    (tmp_path / "runtime").mkdir(exist_ok=True)
    (tmp_path / "runtime/loop.py").write_text("import sys\nsys.path.insert(0, '.')\n\ndef run():\n"
                                               + "    x = 1\n" * 80)
    subprocess.run(["git", "-C", str(tmp_path), "add", "-A"], check=True)
    assert find_long_functions(tmp_path) == ["runtime/loop.py:4 run is 81 lines"]
    assert find_sys_path_edits(tmp_path) == ["runtime/loop.py:2"]
