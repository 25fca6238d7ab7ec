"""The documentation a newcomer relies on stays true to the code."""

from __future__ import annotations

from pathlib import Path

from shared.config import Config

ROOT = Path(__file__).resolve().parent.parent


def test_every_setting_is_documented_in_operations():
    text = (ROOT / "docs" / "operations.md").read_text()
    missing = [f for f in Config.__struct_fields__ if f"TENSORBUS_{f.upper()}" not in text]
    assert not missing, f"undocumented settings: {missing} (run scripts/config_table.py)"


def test_readme_starts_with_the_two_setup_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("```bash", 1)[1].split("```", 1)[0].strip().splitlines()
    assert [line.split("#")[0].strip() for line in block] == ["scripts/up.sh", "scripts/test.sh"]
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_procfile_holds_long_running_services_only():
    names = [line.split(":", 1)[0] for line in (ROOT / "Procfile").read_text().splitlines() if line.strip()]
    assert names == ["nats", "gateway", "scheduler", "worker", "lm", "telemetry"]
