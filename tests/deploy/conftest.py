"""The rendered overlays and components, once per session (kustomize and checkov take
seconds each)."""

from __future__ import annotations

import pytest

from tests.deploy.render import Doc, checkov, render, targets


@pytest.fixture(scope="session")
def rendered() -> dict[str, tuple[Doc, ...]]:
    """Every target's objects, by name (`overlays/dev`, ...)."""
    return {target.name: render(target) for target in targets()}


@pytest.fixture(scope="session")
def checkov_report(rendered: dict[str, tuple[Doc, ...]]) -> Doc:
    return checkov(rendered)
