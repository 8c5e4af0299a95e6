"""The core (inspect, rewrite, evaluate, diagnose) imports and runs with torch and transformers absent."""

import subprocess
import sys

SCRIPT = """
import sys
for name in ("torch", "transformers", "optimum"):
    sys.modules[name] = None  # any import of them now raises ImportError
from surgery.cli import app
for args in (["inspect", "{src}"], ["parallelize", "{src}", "--layers", "0", "-o", "{out}/p"],
             ["evaluate", "{src}", "{out}/p", "--seq-len", "32", "--max-windows", "2", "--repeats", "2"],
             ["diagnose", "{src}", "-o", "{out}/r", "--seq-len", "32", "--windows", "1", "--eval-windows", "1", "--only", "deficit,defect"]):
    try:
        app(args)
    except SystemExit as e:
        assert e.code in (0, None), (args, e.code)
missing = [m for m in ("torch", "transformers") if sys.modules.get(m) is not None]
print("OK", missing)
"""


def test_core_commands_run_without_torch(tmp_path, fixture_path):
    script = SCRIPT.replace("{src}", str(fixture_path("llama"))).replace("{out}", str(tmp_path))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "OK []" in run.stdout


def test_export_without_torch_names_the_install_command(tmp_path):
    script = (
        "import sys\nsys.modules['torch'] = None\nfrom surgery.cli import app\n"
        f"app(['export', 'gpt2', '-o', {str(tmp_path / 'x')!r}])\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 1
    assert "pip install torch==2.13.0" in run.stderr and "Traceback" not in run.stderr
