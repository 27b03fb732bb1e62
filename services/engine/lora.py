"""The simulated engine's LoRA adapters, as vLLM keeps them: `--enable-lora` with
`--max-loras` (the adapters one batch runs), adapters registered by `--lora-modules` at start
or at run time through `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (served only
with `VLLM_ALLOW_RUNTIME_LORA_UPDATING` set, as vLLM's are), answered with vLLM's bodies and
statuses. A request names an adapter in `model`; its blocks hash with the adapter's name and
path, as vLLM's do. No weights exist here: an adapter costs its requests nothing more."""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvsched.core.vllm_hashing import AdapterKey
from services.common.serving.api_errors import ApiError
from services.common.serving.flags import parse_bool

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updates_allowed() -> bool:
    return parse_bool(os.environ.get(RUNTIME_UPDATES_ENV, ""))


class Adapters:
    """The adapters an engine has registered: name -> path."""

    def __init__(self, base_model: str, capacity: int, preloaded: Mapping[str, str]) -> None:
        self.base_model = base_model
        self.capacity = capacity  # --max-loras
        self.paths: dict[str, str] = dict(preloaded)

    def key(self, model: str) -> AdapterKey | None:
        """The adapter `model` names, None for the base model; raises vLLM's 404 for a name
        the engine does not serve."""
        if model == self.base_model:
            return None
        path = self.paths.get(model)
        if path is None:
            raise ApiError(404, f"The model `{model}` does not exist.", type_="NotFoundError",
                           param="model")  # fmt: skip
        return (model, path)

    def load(self, body: object) -> str:
        """`/v1/load_lora_adapter`'s answer, or its error (vLLM's words and statuses)."""
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        if not name or not path:
            raise _invalid("Both 'lora_name' and 'lora_path' must be provided.")
        if name == self.base_model:
            raise _invalid(f"The lora adapter '{name}' conflicts with a served base model.")
        if name in self.paths:
            raise _invalid(f"The lora adapter '{name}' has already been loaded. If you want to "
                           "load the adapter in place, set 'load_inplace' to True.")  # fmt: skip
        self.paths[name] = path
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, body: object) -> str:
        """`/v1/unload_lora_adapter`'s answer, or its error."""
        name = _field(body, "lora_name")
        if not name:
            raise _invalid("'lora_name' needs to be provided to unload a LoRA adapter.")
        if self.paths.pop(name, None) is None:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.",
                           type_="NotFoundError")  # fmt: skip
        return f"Success: LoRA adapter '{name}' removed successfully."


def _field(body: object, key: str) -> str:
    value = body.get(key) if isinstance(body, dict) else None
    return value if isinstance(value, str) else ""


def _invalid(message: str) -> ApiError:
    return ApiError(400, message, type_="InvalidUserInput")
