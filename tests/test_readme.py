from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text().splitlines()
    test_command = readme[readme.index("# 2. install and run the tests") + 1]
    assert "pytest" in test_command
    assert test_command in (ROOT / ".ci" / "run").read_text().splitlines()
