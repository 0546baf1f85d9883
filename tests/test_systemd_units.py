"""The systemd units in systemd/: `systemd-analyze verify` and the settings the store relies on."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

import pytest

UNIT_DIR = Path(__file__).resolve().parent.parent / "systemd"
DAEMONS = ("slidedp-hoststate", "slidedp-aggregator", "slidedp-updater")
SERVICES = {name: UNIT_DIR / f"{name}@.service" for name in DAEMONS}
TARGET = UNIT_DIR / "slidedp@.target"
INSTANCE = "demo"


def unit_settings(unit_path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) for every assignment of a unit file, in order; comments dropped."""
    settings, section, pending = [], "", ""
    for raw in unit_path.read_text().splitlines():
        line = pending + raw.strip()
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):  # continuation line
            pending = line[:-1] + " "
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{unit_path.name}: not an assignment: {line!r}"
        settings.append((section, key.strip(), value.strip()))
    return settings


def setting(unit_path: Path, section: str, key: str) -> list[str]:
    return [v for s, k, v in unit_settings(unit_path) if s == section and k == key]


def unit_exec_start(unit_path: Path) -> list[str]:
    """The ExecStart= command lines of a unit's [Service] section."""
    return [v for v in setting(unit_path, "Service", "ExecStart") if v]


def _systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool:
        return tool
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail("systemd-analyze is not installed and CI=true: run scripts/install-systemd-tools.sh before the tests")
    pytest.skip("systemd-analyze is not installed (scripts/install-systemd-tools.sh installs it; with CI=true this fails)")


def verify(unit_dir: Path, names: list[str]) -> tuple[int, list[str]]:
    """Run `systemd-analyze verify` on instances of the templates in unit_dir.

    Returns its exit code and the lines of output about our units: verify exits 0 on
    unknown keys and unparsable values, so those lines are the real verdict.
    """
    done = subprocess.run(
        [_systemd_analyze(), "verify", *(str(unit_dir / n) for n in names)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LC_ALL": "C", "SYSTEMD_LOG_COLOR": "0"},
    )
    lines = (done.stdout + done.stderr).splitlines()
    return done.returncode, [line for line in lines if "slidedp" in line or str(unit_dir) in line]


INSTANCES = [f"{name}@{INSTANCE}.service" for name in DAEMONS] + [f"slidedp@{INSTANCE}.target"]


def test_systemd_analyze_verify_passes_without_warnings(tmp_path: Path) -> None:
    for unit in [*SERVICES.values(), TARGET]:
        shutil.copy(unit, tmp_path / unit.name)
    rc, about_us = verify(tmp_path, INSTANCES)
    assert about_us == []
    assert rc == 0


def test_verify_check_catches_a_broken_unit(tmp_path: Path) -> None:
    # The check above is only worth something if a typo in our units shows up in it.
    for unit in [*SERVICES.values(), TARGET]:
        text = unit.read_text()
        if unit.name == "slidedp-aggregator@.service":
            text = text.replace("Type=notify\n", "Type=notfy\n").replace("UMask=0077\n", "UMsk=0077\n")
        (tmp_path / unit.name).write_text(text)
    rc, about_us = verify(tmp_path, INSTANCES)
    assert rc == 0
    assert len(about_us) == 2
    assert re.search(r"slidedp-aggregator@\.service:\d+: Failed to parse service type, ignoring: notfy$", about_us[0])
    assert re.search(r"slidedp-aggregator@\.service:\d+: Unknown key( name)? 'UMsk' in section '?\[?Service", about_us[1])


@pytest.mark.parametrize("daemon", DAEMONS)
def test_exec_start_runs_the_console_script_for_the_instance(daemon: str) -> None:
    unit = SERVICES[daemon]
    (line,) = unit_exec_start(unit)
    assert re.fullmatch(rf"(\S*/)?(env )?{daemon} --store %i", line), line
    assert line == f"/usr/bin/env {daemon} --store %i"
    # env finds the script through the unit's PATH, which starts at the venv.
    (path,) = [v.split("=", 1)[1] for v in setting(unit, "Service", "Environment") if v.startswith("PATH=")]
    assert path.split(":")[0] == "/opt/slidedp/venv/bin"
    scripts = {ep.name for ep in metadata.distribution("slidedp").entry_points if ep.group == "console_scripts"}
    assert daemon in scripts


@pytest.mark.parametrize("daemon", DAEMONS)
def test_service_settings_the_store_relies_on(daemon: str) -> None:
    unit = SERVICES[daemon]
    expected = {
        "Type": "notify",
        "NotifyAccess": "main",
        "WatchdogSec": "30s",
        "Restart": "on-failure",
        "KillSignal": "SIGTERM",
        "LimitMEMLOCK": "infinity",
        "RuntimeDirectory": "slidedp/%i",
        "RuntimeDirectoryPreserve": "yes",
        "RuntimeDirectoryMode": "0700",
        "User": "slidedp",
        "Group": "slidedp",
        "UMask": "0077",
        "StandardOutput": "journal",
        "StandardError": "journal",
    }
    assert {key: setting(unit, "Service", key) for key in expected} == {k: [v] for k, v in expected.items()}
    for key in ("TimeoutStopSec", "RestartSec"):
        assert len(setting(unit, "Service", key)) == 1, key
    # Each of these would delete or hide the store or the run directory (see the unit's comment).
    keys = {k for _, k, _ in unit_settings(unit)}
    assert keys.isdisjoint({"RemoveIPC", "PrivateIPC", "DynamicUser", "PrivateTmp"})
    assert setting(unit, "Unit", "PartOf") == ["slidedp@%i.target"]


@pytest.mark.parametrize("daemon", ["slidedp-aggregator", "slidedp-updater"])
def test_aggregator_and_updater_are_bound_to_the_hoststate_daemon(daemon: str) -> None:
    unit = SERVICES[daemon]
    assert setting(unit, "Unit", "BindsTo") == ["slidedp-hoststate@%i.service"]
    assert setting(unit, "Unit", "After") == ["slidedp-hoststate@%i.service"]


def test_hoststate_depends_on_no_other_daemon() -> None:
    unit = SERVICES["slidedp-hoststate"]
    assert setting(unit, "Unit", "BindsTo") == setting(unit, "Unit", "After") == []


def test_target_pulls_in_all_three_daemons() -> None:
    wants = " ".join(setting(TARGET, "Unit", "Wants")).split()
    assert wants == [f"{name}@%i.service" for name in DAEMONS]
    assert setting(TARGET, "Install", "WantedBy") == ["multi-user.target"]
