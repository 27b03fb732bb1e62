"""The CRD schemas shipped in `deploy/crds/` (upstream CRD YAML, one file per CRD), made
strict as `kubectl apply --validate=strict` is: a field a schema does not name is an error,
not silently pruned by the API server."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema

from tests.conftest import REPO
from tests.deploy.monitoring import load_yaml

CRDS = REPO / "deploy" / "crds"


def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) → the strict openAPIV3Schema of every served version."""
    schemas = {}
    for path in sorted(CRDS.glob("*.yaml")):
        for crd in load_yaml(path):
            assert crd["kind"] == "CustomResourceDefinition", path
            spec = crd["spec"]
            for version in spec["versions"]:
                if version.get("served", True):
                    api = f"{spec['group']}/{version['name']}"
                    schema = version["schema"]["openAPIV3Schema"]
                    schemas[api, spec["names"]["kind"]] = strict(schema)
    return schemas


def strict(schema: dict[str, Any]) -> dict[str, Any]:
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


def validation_errors(obj: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """What is wrong with custom resource `obj` by `schema` (OpenAPI v3.0: JSON Schema
    draft 4's rules), each error with its path."""
    validator = jsonschema.Draft4Validator(schema)
    return [
        f"{'/'.join(map(str, err.absolute_path)) or '(root)'}: {err.message}"
        for err in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.path)))
    ]
