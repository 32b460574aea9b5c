"""GET /openapi.json: an OpenAPI 3.1 document of the HTTP API, generated from the pydantic models of
protocol.py (request bodies validate as documented; unknown fields of the OpenAI requests are ignored,
so their schemas allow additional properties, and /generate's forbid them)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

import jaxserve
from jaxserve.server import protocol

_REF = "#/components/schemas/{model}"

# (method, path, summary, request model or None, response model or None)
_OPERATIONS: tuple[tuple[str, str, str, type[BaseModel] | None, type[BaseModel] | None], ...] = (
    ("post", "/generate", "SGLang's native generation API", protocol.GenerateRequest, protocol.GenerateOutput),
    ("post", "/v1/completions", "OpenAI completions", protocol.CompletionRequest, protocol.CompletionResponse),
    ("post", "/v1/chat/completions", "OpenAI chat completions", protocol.ChatCompletionRequest, protocol.ChatCompletionResponse),
    ("post", "/v1/responses", "OpenAI Responses API (a Response object; named events when stream)", protocol.ResponsesRequest, None),
    ("get", "/v1/responses/{response_id}", "a stored response; 404 (param response_id) for an unknown id", None, None),
    ("delete", "/v1/responses/{response_id}", "forget a stored response; 404 (param response_id) for an unknown id", None, None),
    ("post", "/v1/responses/{response_id}/cancel", "stop a background response (status cancelled); 400 for one not "
     "created with background, 404 (param response_id) for an unknown id", None, None),
    ("get", "/v1/responses/{response_id}/input_items", "the input items of a stored response's request, a cursor "
     "page (query: after, limit 1-100, order asc|desc); 404 (param response_id) for an unknown id", None, None),
    ("post", "/tokenize", "SGLang's: the token ids of a prompt (or a list of them) or of chat messages rendered "
     "as a chat completion would", protocol.TokenizeRequest, protocol.TokenizeResponse),
    ("post", "/v1/tokenize", "the same as /tokenize", protocol.TokenizeRequest, protocol.TokenizeResponse),
    ("post", "/detokenize", "SGLang's: the text of a list of token ids (or a text per list); an id outside the "
     "vocabulary is a 400 naming it", protocol.DetokenizeRequest, protocol.DetokenizeResponse),
    ("post", "/v1/detokenize", "the same as /detokenize", protocol.DetokenizeRequest, protocol.DetokenizeResponse),
    ("get", "/v1/models", "the served model", None, protocol.ModelList),
    ("get", "/v1/models/{model}", "the served model's card; 404 (model_not_found) for another name", None,
     protocol.ModelCard),
    ("get", "/health", "200 while the engine loop runs", None, None),
    ("get", "/health_generate", "generates one token", None, None),
    ("get", "/get_model_info", "model path and name", None, None),
    ("get", "/get_server_info", "server args, queue sizes, KV pool usage, memory", None, None),
    ("get", "/model_info", "model path and name (SGLang's current name of /get_model_info)", None, None),
    ("get", "/server_info", "server args, queue sizes, KV pool usage, memory (SGLang's current name of /get_server_info)", None, None),
    ("get", "/get_load", "SGLang's per-rank load list (requests, KV tokens), polled by sglang-router", None, None),
    ("post", "/flush_cache", "empty the prefix cache", None, None),
    ("post", "/abort_request", "stop a request by rid, or every request (abort_all)", None, None),
    ("post", "/load_lora_adapter", "load a PEFT LoRA adapter (needs --enable-lora); 400 with success false when it "
     "cannot serve this model", protocol.LoadLoRAAdapterRequest, protocol.LoRAUpdateOutput),
    ("post", "/unload_lora_adapter", "unload a LoRA adapter; answers once its running requests finished",
     protocol.UnloadLoRAAdapterRequest, protocol.LoRAUpdateOutput),
)

_ABORT_BODY = {"type": "object", "properties": {"rid": {"type": "string", "minLength": 1}, "abort_all": {"type": "boolean"}},
               "anyOf": [{"required": ["rid"]}, {"required": ["abort_all"], "properties": {"abort_all": {"const": True}}}]}
# a name may contain slashes (`org/name`): the route matches the rest of the path
_PATH_PARAMETERS = {"/v1/models/{model}": ({"name": "model", "in": "path", "required": True, "schema": {"type": "string"},
                                            "description": "the served model name, as /v1/models lists it"},),
                    "/v1/responses/{response_id}": ({"name": "response_id", "in": "path", "required": True,
                                                     "schema": {"type": "string"}, "description": "a stored response's id"},)}
_PATH_PARAMETERS["/v1/responses/{response_id}/cancel"] = _PATH_PARAMETERS["/v1/responses/{response_id}"]
_PATH_PARAMETERS["/v1/responses/{response_id}/input_items"] = _PATH_PARAMETERS["/v1/responses/{response_id}"] + (
    {"name": "after", "in": "query", "schema": {"type": "string"}, "description": "an item id: the page starts after it"},
    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}},
    {"name": "order", "in": "query", "schema": {"type": "string", "enum": ["asc", "desc"], "default": "desc"}},
)
_NOT_FOUND = {"/v1/models/{model}": "no model of that name (code model_not_found, param model)",
              "/v1/responses/{response_id}": "no stored response of that id (code not_found, param response_id)"}
_NOT_FOUND["/v1/responses/{response_id}/cancel"] = _NOT_FOUND["/v1/responses/{response_id}"]
_NOT_FOUND["/v1/responses/{response_id}/input_items"] = _NOT_FOUND["/v1/responses/{response_id}"]
_ERROR = {
    "type": "object",
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
        "required": ["message", "type"]}},
    "required": ["error"],
}


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document (a JSON-ready dict). Every operation documents a 400 with the error body."""
    models = sorted({m for op in _OPERATIONS for m in op[3:] if m is not None}, key=lambda m: m.__name__)
    refs, defs = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    schemas = dict(defs.get("$defs", {}))
    schemas["ErrorResponse"] = _ERROR
    paths: dict[str, dict[str, Any]] = {}
    for method, path, summary, request_model, response_model in _OPERATIONS:
        op: dict[str, Any] = {"summary": summary, "operationId": f"{method}_{path.strip('/').replace('/', '_')}"}
        body = refs[(request_model, "validation")] if request_model is not None else (
            _ABORT_BODY if path == "/abort_request" else None)
        if body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
        ok = {"description": "OK"}
        if response_model is not None:
            ok["content"] = {"application/json": {"schema": refs[(response_model, "validation")]}}
        error = {"description": "bad request", "content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}}
        op["responses"] = {"200": ok, "400": error}
        if path in _PATH_PARAMETERS:
            op["parameters"] = list(_PATH_PARAMETERS[path])
        if path in _NOT_FOUND:
            op["responses"]["404"] = {**error, "description": _NOT_FOUND[path]}
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "jaxserve", "version": getattr(jaxserve, "__version__", "0.1.0"),
                 "description": "SGLang's native API and the OpenAI API (docs/api.md)"},
        "paths": paths,
        "components": {"schemas": schemas},
    }
