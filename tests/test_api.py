"""The public API: `import surgery` stays light, names no submodule, and docs/api.md's worked example runs as written."""

import math
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import surgery

ROOT = Path(__file__).resolve().parents[1]


def test_every_public_name_resolves_and_none_shadows_a_submodule():
    submodules = {m.name for m in pkgutil.iter_modules(surgery.__path__)}
    assert not submodules & set(surgery.__all__), "a public name hides a submodule (from surgery import X expects the module)"
    for name in surgery.__all__:
        assert getattr(surgery, name) is not None, name
    assert set(surgery.__all__) <= set(dir(surgery))
    assert surgery.fit.__module__ == "surgery.compensation.fitting" and surgery.apply_pass.__module__ == "surgery.passes.driver"


def test_an_unknown_name_is_an_attribute_error():
    try:
        surgery.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("surgery.no_such_name resolved")


def test_import_surgery_imports_no_heavy_module():
    code = "import sys, surgery; print(sorted(m for m in ('onnx_ir', 'onnx', 'numpy', 'onnxruntime', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]"


def test_the_submodules_stay_modules_after_the_api_is_used():
    surgery.compare, surgery.windows, surgery.select_layers  # noqa: B018
    from surgery.files import graph
    from surgery.jobs import select
    from surgery.measure import scoring

    assert scoring.__name__ == "surgery.measure.scoring" and select.__name__ == "surgery.jobs.select" and graph.__name__ == "surgery.files.graph"


def test_the_worked_example_in_docs_api_runs_as_written(monkeypatch, capsys):
    page = (ROOT / "docs" / "api.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", page, flags=re.MULTILINE | re.DOTALL)
    assert blocks, "docs/api.md has no python block"
    monkeypatch.chdir(ROOT)  # the example reads graphs/tiny-llama relative to the repository root
    namespace: dict = {"__name__": "__docs__"}
    exec(compile("\n".join(blocks), "docs/api.md", "exec"), namespace)
    printed = capsys.readouterr().out
    assert "3 blocks" in printed
    base, hurt = namespace["base"], namespace["hurt"]
    assert math.isfinite(base.loss) and math.isfinite(hurt.loss) and hurt.tokens == base.tokens > 0
    assert hurt.loss != base.loss and namespace["ablation_kl"].kl > 0  # removing an mlp changed the model
    assert 0 < namespace["plain_kl"] < 1 and 0 < namespace["fixed_kl"] < 1
    assert namespace["forms"][:2] == ["parallel", "parallel"] and namespace["forms"][2] == "sequential"
    assert all(math.isfinite(f.c_comp) for f in namespace["fits"].values())
