"""OpenAI's model routes: GET /v1/models (the list) and GET /v1/models/{model} (one card).

The server serves one model, under `--served-model-name` (or the checkpoint's name). As SGLang 0.5.23's
`retrieve_model`, a name other than that one is a 404 with OpenAI's error body, `code` `model_not_found`
and `param` `model`.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.server.errors import error_body
from jaxserve.server.protocol import ModelCard, ModelList


def _served_card(request: Request) -> ModelCard:
    engine_loop = request.app.state.engine_loop
    return ModelCard(id=request.app.state.model_name, root=engine_loop.engine.runner.model_path, max_model_len=engine_loop.engine.limits.context_length)


def _adapter_cards(request: Request) -> list[ModelCard]:
    """A card per loaded LoRA adapter (SGLang's: id the adapter's name, root its path, parent the
    served model)."""
    adapters = request.app.state.engine_loop.engine.loaded_lora_adapters()
    return [ModelCard(id=name, root=path, parent=request.app.state.model_name) for name, path in adapters.items()]


async def models(request: Request) -> Response:
    """GET /v1/models: the served model's card, then one per loaded LoRA adapter."""
    return JSONResponse(ModelList(data=[_served_card(request), *_adapter_cards(request)]).model_dump())


async def retrieve_model(request: Request) -> Response:
    """GET /v1/models/{model}: the served model's card; 404 (`model_not_found`) for any other name.

    `model` may contain slashes (`org/name`), as served names taken from a path can.
    """
    model = request.path_params["model"]
    card = _served_card(request)
    if model != card.id:
        body = error_body(f"The model '{model}' does not exist", 404, param="model", code="model_not_found")
        body["error"]["type"] = "invalid_request_error"  # OpenAI's (and SGLang's) type for an unknown model
        return JSONResponse(body, status_code=404)
    return JSONResponse(card.model_dump())
