"""The framework versions under ``audiosite.http`` are the ones its overrides were checked against.

``audiosite.http`` subclasses and patches private internals of Django, asgiref, adrf, DRF, daphne,
Twisted and autobahn (its module doc lists each). A new version of any of them can change those
internals silently; these tests fail until someone re-reads the listed internals and bumps the pin.
"""
from __future__ import annotations

import importlib.metadata
import re

import pytest

import audiosite.http
from audiosite.http import FRAMEWORK_PINS

from .support.processes import ROOT

#: The frameworks whose internals the package touches; each must be pinned.
OVERRIDDEN_FRAMEWORKS = ("django", "daphne", "twisted", "adrf", "djangorestframework", "channels", "asgiref",
                         "autobahn")


def _requirements_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        found = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;]+)", line)
        if found:
            pins[found.group(1).lower()] = found.group(2)
    return pins


def test_every_overridden_framework_is_pinned():
    assert set(OVERRIDDEN_FRAMEWORKS) <= set(FRAMEWORK_PINS)


@pytest.mark.parametrize("name", sorted(FRAMEWORK_PINS))
def test_the_installed_version_is_the_pinned_one(name):
    installed = importlib.metadata.version(name)
    assert installed == FRAMEWORK_PINS[name], (
        f"{name} {installed} is installed, audiosite.http was checked against {FRAMEWORK_PINS[name]}: re-read "
        f"the internals its module doc lists for {name}, adapt, then bump audiosite.http.FRAMEWORK_PINS")


@pytest.mark.parametrize("name", sorted(FRAMEWORK_PINS))
def test_requirements_and_the_module_doc_name_the_pinned_version(name):
    assert _requirements_pins().get(name) == FRAMEWORK_PINS[name]
    doc = audiosite.http.__doc__ or ""
    assert re.search(rf"\b{re.escape(name)} {re.escape(FRAMEWORK_PINS[name])}\b", doc, re.IGNORECASE), (
        f"audiosite.http's doc does not name {name} {FRAMEWORK_PINS[name]}")
