"""vLLM's runtime LoRA routes, present only with --allow-runtime-lora (else 404): POST /v1/load_lora_adapter and
/v1/unload_lora_adapter. Behind the API key like every /v1 route when keys are configured."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from services.tokenizer.openai.serving import OpenAIServing


class LoadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str


def add_lora_routes(app: FastAPI, serving: OpenAIServing) -> None:
    registry = serving.state.loras
    errors = {400: {"description": "a bad name or adapter"}, 404: {"description": "no adapter of that name"}}

    @app.post("/v1/load_lora_adapter", responses=errors)
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> PlainTextResponse:
        registry.load(body.lora_name, body.lora_path, serving.state.model_info().model)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", responses=errors)
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> PlainTextResponse:
        registry.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
