"""Validating rendered objects: built-in ones with kubernetes-validate in strict mode against
a pinned Kubernetes version, custom resources against the CRD schemas shipped in `deploy/crds/`
(upstream CRD YAML, one file per CRD), made strict as `kubectl apply --validate=strict` is: a
field a schema does not name is an error, not silently pruned by the API server."""

from __future__ import annotations

import copy
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from tests.deploy.render import Doc, to_yaml
from tests.deploy.tools import DEPLOY, run_tool

KUBERNETES_VERSION = "1.34.0"  # what kubernetes-validate checks built-in objects against
Schemas = dict[tuple[str, str], Doc]  # (apiVersion, kind) -> openAPIV3Schema


def builtin_errors(docs: list[Doc]) -> list[str]:
    """kubernetes-validate --strict's complaints about `docs` (empty: all validate). An object
    it has no schema for is a complaint too: every kind must be checked by something."""
    if not docs:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "objects.yaml"
        path.write_text(to_yaml(docs), encoding="utf-8")
        result = run_tool(
            "kubernetes-validate", "--strict", "-k", KUBERNETES_VERSION, "--quiet", str(path)
        )
    lines = (result.stdout + result.stderr).splitlines()
    errors = [line for line in lines if line.startswith(("ERROR", "WARN"))]
    if result.returncode != 0 and not errors:
        errors = lines or [f"kubernetes-validate exited {result.returncode}"]
    return errors


@cache
def crd_schemas() -> Schemas:
    """The strict openAPIV3Schema of every served version of every CRD in `deploy/crds/`."""
    schemas: Schemas = {}
    for path in sorted((DEPLOY / "crds").glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if not crd:
                continue
            assert crd["kind"] == "CustomResourceDefinition", path
            spec = crd["spec"]
            for version in spec["versions"]:
                if version.get("served", True):
                    api = f"{spec['group']}/{version['name']}"
                    schemas[api, spec["names"]["kind"]] = strict(
                        version["schema"]["openAPIV3Schema"]
                    )
    return schemas


def strict(schema: Doc) -> Doc:
    """`schema` with `additionalProperties: false` on every object that lists its properties
    and neither allows more nor keeps unknown fields (x-kubernetes-preserve-unknown-fields)."""
    out = copy.deepcopy(schema)

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(out)
    return out


def is_custom(doc: Doc, schemas: Schemas) -> bool:
    """Whether `doc` is a custom resource of a CRD the repository ships."""
    return (str(doc.get("apiVersion")), str(doc.get("kind"))) in schemas


def custom_errors(doc: Doc, schemas: Schemas) -> list[str]:
    """Where custom resource `doc` breaks its CRD's schema (empty: it validates), each error
    with its path. OpenAPI v3.0 schemas follow JSON Schema draft 4's rules."""
    validator = jsonschema.Draft4Validator(schemas[str(doc["apiVersion"]), str(doc["kind"])])
    name = f"{doc['kind']}/{doc.get('metadata', {}).get('name')}"
    return [
        f"{name}: {'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.path)))
    ]
