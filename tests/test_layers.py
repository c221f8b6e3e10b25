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
