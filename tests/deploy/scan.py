"""The static security scan of the rendered manifests: checkov, one run over every target."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from tests.deploy.render import Doc, to_yaml
from tests.deploy.tools import run_tool


def checkov(rendered: dict[str, tuple[Doc, ...]]) -> Doc:
    """checkov's JSON report over every rendered target (one file each): a list of one report
    per framework, under `reports`."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, docs in rendered.items():
            (Path(tmp) / f"{name.replace('/', '-')}.yaml").write_text(to_yaml(docs))
        args = ["-d", tmp, "--framework", "kubernetes", "--skip-download", "--quiet", "-o", "json"]
        result = run_tool("checkov", *args, timeout=300)
    report = json.loads(result.stdout)
    return {"reports": report if isinstance(report, list) else [report]}
