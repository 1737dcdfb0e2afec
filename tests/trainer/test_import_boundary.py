"""The trainer talks to models only through the Tinker client interface: nothing under
skyrl_trainer/trainer, envs, rewards or data imports backend, server, engine or model code."""

import ast
import subprocess
import sys
from pathlib import Path

import skyrl_trainer

PACKAGE = Path(skyrl_trainer.__file__).parent
TRAINER_SIDE = ("trainer", "envs", "rewards", "data")
FORBIDDEN = ("skyrl_trainer.backend", "skyrl_trainer.server", "vllm", "peft", "transformers")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_trainer_side_sources_import_no_backend_code():
    offenders = []
    for folder in TRAINER_SIDE:
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            for name in imported_modules(path):
                bad = any(name == f or name.startswith(f + ".") for f in FORBIDDEN)
                if bad or (name.split(".")[0] == "torch" and name != "torch.utils.tensorboard"):
                    offenders.append(f"{path.relative_to(PACKAGE)}: {name}")
    assert not offenders, offenders


def test_importing_the_loop_loads_no_backend_module():
    code = (
        "import sys, skyrl_trainer.trainer.loop\n"
        "bad = [m for m in sys.modules if m.startswith(('skyrl_trainer.backend', 'vllm', 'peft'))]\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
