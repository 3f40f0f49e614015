"""The LoRA adapters this frontend serves by name: those of --lora-modules and those loaded at run time.

A request names an adapter (the OpenAI ``model`` field, ``GenerateRequest.lora_name``); the registry turns the name
into the ``LoraRequest`` (name and path) that travels with the request to the worker, which reads the adapter
itself. Adapters are checked here when they are named (config, files, rank), so a request never carries one the
worker would refuse for those reasons. Each frontend process holds its own registry: with --api-server-count > 1,
a runtime load reaches the process that answered it only.
"""

from __future__ import annotations

import os

from kvgrid.v1 import common_pb2
from services.common.config_requests import LoraConfig
from services.common.errors import InvalidArgument, NotFound
from services.common.lora_adapters import LoraError, check_rank, read_config


class LoraNotFound(NotFound):
    def __init__(self, name: str):
        super().__init__(f"no LoRA adapter named `{name}` is loaded")


class LoraRegistry:
    def __init__(self, config: LoraConfig | None = None):
        """Checks every adapter of --lora-modules; raises ValueError naming a bad one."""
        config = config or LoraConfig()
        self.enabled = config.enable_lora
        self.allow_runtime = config.allow_runtime_lora
        self.max_rank = config.max_lora_rank
        self._adapters: dict[str, str] = {}
        for name, path in config.modules.items():
            try:
                self._adapters[name] = self._checked(path)
            except LoraError as exc:
                raise ValueError(f"--lora-modules {name}: {exc}") from None

    def _checked(self, path: str) -> str:
        path = os.path.abspath(path)
        check_rank(read_config(path), self.max_rank, path)
        return path

    def names(self) -> list[str]:
        return list(self._adapters)

    def path(self, name: str) -> str:
        return self._adapters[name]

    def has(self, name: str) -> bool:
        return name in self._adapters

    def resolve(self, name: str, field: str = "lora_name") -> common_pb2.LoraRequest | None:
        """The adapter a request names; None for no name; NotFound for an unknown one."""
        if not name:
            return None
        path = self._adapters.get(name)
        if path is None:
            raise LoraNotFound(name)
        return common_pb2.LoraRequest(name=name, path=path)

    def load(self, name: str, path: str, served_model: str) -> None:
        """--allow-runtime-lora's load: raises InvalidArgument for a taken name or an adapter it cannot serve."""
        if not name or not path:
            raise InvalidArgument("lora_name" if not name else "lora_path", "must not be empty")
        if name in self._adapters or name == served_model:
            raise InvalidArgument("lora_name", f"the name `{name}` is already in use")
        try:
            self._adapters[name] = self._checked(path)
        except LoraError as exc:
            raise InvalidArgument("lora_path", str(exc)) from None

    def unload(self, name: str) -> None:
        if self._adapters.pop(name, None) is None:
            raise LoraNotFound(name)
