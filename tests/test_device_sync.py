"""No device-wide synchronize in the step path (issue 28, item 1 of the NCCL table).

On NCCL, torch.cuda.synchronize() waits for every operation the rank has posted, sends and receives
included: a rank that posted a receive whose sender waits for this rank's later work hangs there
(docs/communication.md). The tracer times spans with device events instead; the only device-wide
synchronizes left are start-up timings, before any rank posts a send, through
parallel.commhooks.synchronize, which records them as "sync" in the communication trace. This test
parses every module of the project and scripts/ and names any other."""
import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ALLOWED = {
    ("parallel/commhooks.py", "synchronize"): "the one device-wide synchronize, recorded in the trace",
    ("runtime/probe.py", "_timed"): "the start-up speed probe, before any rank posts a send",
    ("runtime/probe.py", "probe_link"): "the start-up link probe: rank 0 waits for its own send and the answer, "
                                        "which the peer posts in the same order, before any other send",
    ("parallel/gap.py", "measure_block_costs"): "GAP's start-up block costs, before any rank posts a send",
    ("lab/calibrate.py", "_sync"): "a calibration script timing kernels alone, not a training run",
    ("scripts/gpu_check/peak_memory.py", "on_device"): "the GPU check's single-process memory phases, no peer rank",
}
"""(file, function) -> why a device-wide synchronize is allowed there"""

DEVICE_WIDE = {("torch", "cuda", "synchronize"), ("torch", "accelerator", "synchronize"), ("cuda", "synchronize"),
               ("accelerator", "synchronize"), ("commhooks", "synchronize")}


def _chain(node) -> tuple[str, ...]:
    """torch.cuda.synchronize -> ("torch", "cuda", "synchronize"); () for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return tuple(reversed(parts))
    return ()


def device_syncs(source: str, path: str) -> list[tuple[str, str, int]]:
    """(path, enclosing function or "<module>", line) of every reference to a device-wide synchronize:
    called or passed on (a tracer's `sync=torch.cuda.synchronize` counts), or imported by name."""
    found = []

    def visit(node, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Attribute) and _chain(child) in DEVICE_WIDE:
                found.append((path, func, child.lineno))
            elif isinstance(child, ast.ImportFrom) and child.module in ("torch.cuda", "torch.accelerator") and \
                    any(a.name == "synchronize" for a in child.names):
                found.append((path, func, child.lineno))
            visit(child, name)

    visit(ast.parse(source), "<module>")
    return found


def test_the_checker_finds_a_device_sync():
    src = ("import torch\nfrom torch.cuda import synchronize\n"
           "def step(tracer):\n    torch.cuda.synchronize()\n    return Tracer(sync=torch.accelerator.synchronize)\n")
    assert device_syncs(src, "x.py") == [("x.py", "<module>", 2), ("x.py", "step", 4), ("x.py", "step", 5)]


def test_no_device_wide_synchronize_outside_the_named_places():
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "*.py"], capture_output=True, text=True,
                           check=True).stdout.split()
    found = []
    for rel in files:
        if rel.startswith("tests/") or not (ROOT / rel).is_file():
            continue
        found += device_syncs((ROOT / rel).read_text(), rel)
    bad = [f"{path}:{line} in {func}" for path, func, line in found if (path, func) not in ALLOWED]
    assert not bad, "device-wide synchronize outside the allowed places (tests/test_device_sync.py):\n" + \
        "\n".join(bad)
    assert {(path, func) for path, func, _ in found} == set(ALLOWED)  # the list names nothing stale
