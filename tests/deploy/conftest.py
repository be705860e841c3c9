"""Fixtures for the deploy/ tests: each overlay is rendered once per session."""

from __future__ import annotations

import pytest
from deploy_render import OVERLAYS, Rendered, render


@pytest.fixture(scope="session")
def rendered_all() -> dict[str, Rendered]:
    return {overlay: render(overlay) for overlay in OVERLAYS}


@pytest.fixture(params=OVERLAYS)
def rendered(request: pytest.FixtureRequest, rendered_all: dict[str, Rendered]) -> Rendered:
    return rendered_all[request.param]
