"""The Starlette app: routes, operational endpoints and `create_app(engine_loop, server_args)`.

Routes:
    POST /generate                 SGLang's native API (native_api.py)
    POST /v1/completions           OpenAI (openai_api.py)
    POST /v1/chat/completions
    GET  /v1/models
    GET  /metrics                  Prometheus metrics (metrics.py), unless --disable-metrics
    GET  /health                   200 while the engine loop runs
    GET  /health_generate          runs one token through the engine
    GET  /get_model_info           model_path, tokenizer_path, is_generation
    GET  /get_server_info          the server args, the engine's counters and KV pool usage
    POST /flush_cache              empty the prefix cache (400 while requests run)
    POST /abort_request            {"rid": ...}
Every error body has OpenAI's shape (errors.py). docs/api.md documents the fields.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import jaxserve
from jaxserve.config import ServerArgs
from jaxserve.engine.engine_loop import EngineLoop
from jaxserve.server import native_api, openai_api
from jaxserve.server.auth import APIKeyMiddleware
from jaxserve.server.engine_client import RequestGroup, preprocess_executor
from jaxserve.server.errors import EXCEPTION_HANDLERS, APIError, error_response, parse_json_body

HEALTH_GENERATE_TIMEOUT_S = 60.0
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_QUANT_SUFFIX = re.compile(r"[.-](q\d\w*|iq\d\w*|f16|f32|bf16)$", re.IGNORECASE)


def served_model_name(server_args: ServerArgs, model_path: str) -> str:
    """The model name the API reports: --served-model-name, else the checkpoint's name
    (`.../SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct`)."""
    if server_args.served_model_name:
        return server_args.served_model_name
    if server_args.model_path == "default":
        return DEFAULT_MODEL_NAME
    name = Path(model_path.rstrip("/")).name
    if name.endswith(".gguf"):
        name = _GGUF_QUANT_SUFFIX.sub("", name[: -len(".gguf")])
    return name


async def health(request: Request) -> Response:
    engine_loop: EngineLoop = request.app.state.engine_loop
    if not engine_loop.is_running:
        return error_response("the engine loop is not running", 503, code="unavailable")
    return JSONResponse({"status": "ok"})


async def health_generate(request: Request) -> Response:
    """Generate one token; 503 when the engine cannot do it within HEALTH_GENERATE_TIMEOUT_S."""
    engine_loop: EngineLoop = request.app.state.engine_loop
    if not engine_loop.is_running:
        return error_response("the engine loop is not running", 503, code="unavailable")
    group = RequestGroup(engine_loop)
    group.submit(engine_loop.tokenize("ping") or [0], {"max_new_tokens": 1, "temperature": 0})
    try:
        outputs = await asyncio.wait_for(group.wait(), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        group.abort()
        return error_response(f"no token generated within {HEALTH_GENERATE_TIMEOUT_S:.0f} s", 503, code="unavailable")
    if (failure := native_api.failure_of(outputs[0])) is not None:
        return error_response(failure[1], 503, code="unavailable")
    return JSONResponse({"status": "ok"})


async def get_model_info(request: Request) -> Response:
    engine_loop: EngineLoop = request.app.state.engine_loop
    args = engine_loop.server_args
    tokenizer_path = args.tokenizer_path if args.tokenizer_path not in (None, "default") else engine_loop.model_path
    return JSONResponse({
        "model_path": engine_loop.model_path,
        "tokenizer_path": tokenizer_path,
        "is_generation": True,
        "served_model_name": request.app.state.model_name,
        "context_length": engine_loop.context_length,
    })


async def get_server_info(request: Request) -> Response:
    """Server args (the API key masked), KV pool usage in tokens, queue sizes and engine counters."""
    engine_loop: EngineLoop = request.app.state.engine_loop
    args = dataclasses.asdict(engine_loop.server_args)
    if args.get("api_key") or request.app.state.server_args.api_key:
        args["api_key"] = "***"
    load = engine_loop.load()
    info: dict[str, Any] = {
        **args,
        "version": getattr(jaxserve, "__version__", "0.1.0"),
        "served_model_name": request.app.state.model_name,
        "resolved_model_path": engine_loop.model_path,
        "context_length": engine_loop.context_length,
        "devices": engine_loop.devices,
        "num_running_reqs": load.num_running_reqs,
        "num_waiting_reqs": load.num_waiting_reqs,
        "num_pending_reqs": load.num_pending_reqs,
        "kv_pool": {
            "total_tokens": load.kv_total_tokens,
            "used_tokens": load.kv_used_tokens,
            "cached_tokens": load.kv_cached_tokens,
            "locked_tokens": load.kv_locked_tokens,
            "token_usage": load.kv_used_tokens / max(1, load.kv_total_tokens),
        },
        "engine_stats": dataclasses.asdict(load.stats),
        "num_step_failures": load.num_step_failures,
        "last_step_time": load.last_step_time,
    }
    return JSONResponse(info)


async def flush_cache(request: Request) -> Response:
    engine_loop: EngineLoop = request.app.state.engine_loop
    try:
        await asyncio.wrap_future(engine_loop.flush_cache())
    except RuntimeError as e:
        return error_response(str(e), 400, code="requests_running")
    return JSONResponse({"success": True, "message": "the prefix cache is empty"})


async def abort_request(request: Request) -> Response:
    """{"rid": "..."} -> {"success": whether a running or queued request had that id}."""
    engine_loop: EngineLoop = request.app.state.engine_loop
    body = parse_json_body(await request.body())
    rid = body.get("rid")
    if not isinstance(rid, str) or not rid:
        raise APIError("rid: a request id (string) is required", 400, param="rid", code="invalid_value")
    return JSONResponse({"success": engine_loop.abort(rid)})


def create_app(engine_loop: EngineLoop, server_args: ServerArgs) -> Starlette:
    """The ASGI app over a started `EngineLoop`. `server_args.api_key` turns on bearer-token auth."""
    routes = [
        Route("/generate", native_api.generate, methods=["POST"]),
        Route("/v1/completions", openai_api.completions, methods=["POST"]),
        Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
        Route("/v1/models", openai_api.models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/get_model_info", get_model_info, methods=["GET"]),
        Route("/get_server_info", get_server_info, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["POST", "GET"]),
        Route("/abort_request", abort_request, methods=["POST"]),
    ]
    model_name = served_model_name(server_args, engine_loop.model_path)
    if not server_args.disable_metrics and engine_loop.load().snapshot is not None:
        routes.append(Route("/metrics", _metrics_endpoint(engine_loop, model_name), methods=["GET"]))
    middleware = [Middleware(APIKeyMiddleware, api_key=server_args.api_key)] if server_args.api_key else []
    app = Starlette(routes=routes, middleware=middleware, exception_handlers=EXCEPTION_HANDLERS)
    app.state.preprocess_executor = preprocess_executor()  # its idle thread ends with the process
    app.state.engine_loop = engine_loop
    app.state.server_args = server_args
    app.state.model_name = model_name
    return app


def _metrics_endpoint(engine_loop: EngineLoop, model_name: str):
    """GET /metrics over the snapshot the engine loop publishes after every step; latency histograms
    observe every output on the loop thread."""
    from jaxserve.server.metrics import CONTENT_TYPE, ServingMetrics

    metrics = ServingMetrics(lambda: engine_loop.load().snapshot, model_name, lambda: engine_loop.load().radix_cache)
    engine_loop.add_output_observer(metrics.observe)

    async def endpoint(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return endpoint
