"""The agent and the CLI never need PyTorch (nor transformers): torch is a test-only dependency of the
exported-model suite. Proven in a fresh interpreter where importing torch raises, importing every
reamer module and running the CLI's help of every command."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BLOCKER = r"""
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    BLOCKED = ("torch", "transformers", "torchvision", "onnxscript", "onnxconverter_common")

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.BLOCKED:
            raise ImportError(f"reamer imported {name}: the agent must never import torch")
        return None

sys.meta_path.insert(0, NoTorch())
"""

IMPORT_ALL = BLOCKER + r"""
import pkgutil, reamer
names = sorted(m.name for m in pkgutil.walk_packages(reamer.__path__, "reamer."))
for name in names:
    __import__(name)
assert not any(m.split(".")[0] in NoTorch.BLOCKED for m in sys.modules), sorted(sys.modules)
print(len(names))
"""

CLI_HELP = BLOCKER + r"""
from click.testing import CliRunner
from reamer.cli.main import cli

def commands(group, path):
    yield path
    for name, sub in getattr(group, "commands", {}).items():
        yield from commands(sub, path + [name])

for path in commands(cli, []):
    result = CliRunner().invoke(cli, [*path, "--help"])
    assert result.exit_code == 0, (path, result.output, result.exception)
assert not any(m.split(".")[0] in NoTorch.BLOCKED for m in sys.modules)
print("ok")
"""


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_every_reamer_module_imports_without_torch():
    done = run(IMPORT_ALL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 30  # every module was walked, not none


def test_the_cli_help_of_every_command_runs_without_torch():
    done = run(CLI_HELP)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def test_the_blocker_blocks():
    """The proof above can fail: the same interpreter set-up refuses a plain `import torch`."""
    done = run(BLOCKER + "import torch\n")
    assert done.returncode != 0 and "must never import torch" in done.stderr
