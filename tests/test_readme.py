"""CI installs exactly as the README says and runs the README's test command."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_commands_are_the_readmes():
    readme = (ROOT / "README.md").read_text()
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in ci if line.startswith(("pip install", "python -m", "python -m venv"))]
    assert any(c.startswith("pip install") for c in commands) and "python -m pytest" in commands
    for command in commands:
        assert command in readme, f".ci/run runs `{command}`, which the README does not show"
