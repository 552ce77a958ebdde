"""Reading the environment writes nothing: only importing ``audiosite.settings`` creates ``var/secret_key``.

``audiosite.env`` holds the environment readers; ``inference.specs`` and
``audiosite.serverconfig`` (imported by tools that never start Django, such as
the validation gate's CLI and the catalogue checks) use them without importing
the settings, whose import generates the secret key into ``AUDIOSITE_VAR_DIR``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .support.processes import ROOT


def _import_in_fresh_interpreter(var_dir: Path, modules: str) -> subprocess.CompletedProcess:
    """Import ``modules`` (comma-separated) in a new interpreter whose ``AUDIOSITE_VAR_DIR`` is ``var_dir``;
    it prints whether ``audiosite.settings`` was imported along the way."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUDIOSITE_")}
    env.update(AUDIOSITE_VAR_DIR=str(var_dir), DJANGO_SETTINGS_MODULE="audiosite.settings")
    code = f"import sys; import {modules}; print('audiosite.settings' in sys.modules)"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("modules", ["inference.specs", "audiosite.serverconfig", "audiosite.env"])
def test_importing_the_specs_or_the_config_creates_no_file(tmp_path, modules):
    var_dir = tmp_path / "var"
    done = _import_in_fresh_interpreter(var_dir, modules)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", f"{modules} imported audiosite.settings"
    assert not var_dir.exists(), sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))


def test_importing_the_settings_still_generates_the_secret_key_once(tmp_path):
    """The contrast that keeps the test above honest: the settings' import does write the key (mode 0600)."""
    var_dir = tmp_path / "var"
    done = _import_in_fresh_interpreter(var_dir, "audiosite.settings")
    assert done.returncode == 0, done.stderr
    key_file = var_dir / "secret_key"
    assert key_file.is_file() and oct(key_file.stat().st_mode & 0o777) == "0o600"
