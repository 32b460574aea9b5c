"""SGLang's run-time LoRA routes: POST /load_lora_adapter {lora_name, lora_path, pinned} and POST
/unload_lora_adapter {lora_name}.

Both answer SGLang 0.5.23's `LoRAUpdateOutput`: `{"success", "error_message", "loaded_adapters": {name:
path}}`, 200 on success and 400 on failure (LoRA not enabled, an adapter that cannot serve this model,
an unknown name), and the server keeps serving. A failure also carries jaxserve's error object
(`error`: message, type, param, code), as every 400 does; a body of the wrong shape gets that object
alone. As SGLang, an unload stops new requests
naming the adapter at once (a 400 naming lora_path) and answers once the requests already running
under it have finished (they finish normally, under the adapter).
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.core.field_types import describe
from jaxserve.model.lora import LoraError
from jaxserve.server.errors import APIError, ErrorJSONResponse, error_body, parse_json_body

UNLOAD_POLL_S = 0.01  # how often an unload checks that the adapter's last request finished


def _update_output(engine, error: ValueError | None = None, param: str | None = None) -> JSONResponse:
    """SGLang's LoRAUpdateOutput: success, or the failure `error` (naming `param`) with the error object."""
    body = {"success": error is None, "error_message": "" if error is None else str(error),
            "loaded_adapters": engine.loaded_lora_adapters()}
    if error is None:
        return JSONResponse(body)
    code = "lora_not_enabled" if "not enabled" in str(error) else "invalid_value"
    return ErrorJSONResponse({**body, **error_body(str(error), 400, param=param, code=code)}, status_code=400)


def _field(body: dict[str, Any], name: str, kind: type, required: bool = True) -> Any:
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, kind) or (kind is str and not value.strip()):
        expected = {str: "a non-empty string", bool: "a boolean"}[kind]
        raise APIError(f"{name}: must be {expected}, got {describe(value)}", 400, param=name,
                       code="invalid_value" if value is not None else "missing_field")
    return value


def _body(raw: bytes, allowed: tuple[str, ...]) -> dict[str, Any]:
    body = parse_json_body(raw)
    unknown = [k for k in body if k not in allowed + ("lora_id",)]
    if unknown:
        raise APIError(f"{unknown[0]}: unknown field; expected {', '.join(allowed)}", 400, param=unknown[0],
                       code="unknown_parameter")
    return body


async def load_lora_adapter(request: Request) -> Response:
    """Read a PEFT adapter (off the event loop) and serve it as `lora_name`."""
    engine = request.app.state.engine_loop.engine
    body = _body(await request.body(), ("lora_name", "lora_path", "pinned"))
    name, path = _field(body, "lora_name", str), _field(body, "lora_path", str)
    pinned = _field(body, "pinned", bool, required=False) or False
    try:
        await asyncio.to_thread(engine.load_lora_adapter, name, path, pinned)
    except LoraError as e:
        return _update_output(engine, e, "lora_path")
    except ValueError as e:
        return _update_output(engine, e, "lora_name")
    return _update_output(engine)


async def unload_lora_adapter(request: Request) -> Response:
    """Stop serving `lora_name`; answer once its running requests have finished."""
    engine = request.app.state.engine_loop.engine
    body = _body(await request.body(), ("lora_name",))
    name = _field(body, "lora_name", str)
    try:
        lora_id = engine.unload_lora_adapter(name)
    except ValueError as e:
        return _update_output(engine, e, "lora_name")
    while engine.lora_in_use(lora_id):
        await asyncio.sleep(UNLOAD_POLL_S)
    return _update_output(engine)
