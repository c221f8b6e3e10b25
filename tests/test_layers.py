"""The package's layering rules hold (tools/check-layers: no import circle between files, lazy imports included, and
no import that points up a floor), and the check can fail: a rule the package breaks on purpose is reported."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_layering_rules_hold():
    proc = subprocess.run(["bash", str(ROOT / "tools" / "check-layers")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "0 circles, 0 broken rules" in proc.stdout


def test_a_broken_rule_is_reported():
    """Negative control: the trainer imports the config, so 'never trainer -> config' must be reported."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "import_graph.py"), "posttrain",
                           "--never", "posttrain.trainer:posttrain.config"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1 and "broken: posttrain.trainer" in proc.stdout


PLACEMENT_KEYS = ("host_paging", "host_memory")
"""Keys that exist only for the one-process placement: they reach it from the config where it is made
(`posttrain.distributed.placement.HostLevers`), never through a worker."""


def _names_in(folder: Path) -> dict[str, set[str]]:
    """Each placement key -> the files under ``folder`` whose code (attributes, names, strings: docstrings too) names it."""
    import ast

    found: dict[str, set[str]] = {key: set() for key in PLACEMENT_KEYS}
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            text = (node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name)
                    else node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else "")
            for key in PLACEMENT_KEYS:
                if key in text:
                    found[key].add(str(path.relative_to(ROOT)))
    return found


def test_the_workers_never_carry_the_placements_own_keys():
    """Following ``host_paging`` / ``host_memory`` from the command line to where they act does not pass through
    workers/; the control: the placement's own file names both."""
    assert _names_in(ROOT / "posttrain" / "workers") == {key: set() for key in PLACEMENT_KEYS}
    placement = _names_in(ROOT / "posttrain" / "distributed")
    assert all("posttrain/distributed/placement.py" in files for files in placement.values())
