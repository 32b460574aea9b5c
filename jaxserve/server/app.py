"""The Starlette app: routes, operational endpoints and `create_app(engine_loop, server_args)`.

Routes:
    POST /generate                 SGLang's native API (native/generate.py)
    POST /v1/completions           OpenAI (openai/chat_completions.py)
    POST /v1/chat/completions
    POST /v1/responses             OpenAI's Responses API (openai/responses/api.py)
    POST /tokenize                 SGLang's: a text's (or chat's) token ids (openai/tokenization.py; also /v1/tokenize)
    POST /detokenize               SGLang's: token ids back to text (also /v1/detokenize)
    GET  /v1/responses/{id}        a stored response (DELETE forgets it)
    POST /v1/responses/{id}/cancel stops a background response
    GET  /v1/responses/{id}/input_items  the input items of a stored response
    GET  /v1/models                the served model (openai/models.py)
    GET  /v1/models/{model}        its card; 404 for another name
    GET  /metrics                  Prometheus metrics (metrics.py), unless --disable-metrics
    GET  /health                   200 while the engine loop runs
    GET  /health_generate          runs one token through the engine
    GET  /get_model_info           model_path, tokenizer_path, is_generation (also as /model_info)
    GET  /get_server_info          the server args, the engine's counters, KV pool usage and memory (also as /server_info)
    GET  /get_load                 SGLang's per-rank load list, which sglang-router polls
    POST /flush_cache              empty the prefix cache (400 while requests run)
    POST /abort_request            {"rid": ...}, or {"abort_all": true}
    POST /freeze_gc                freeze the objects alive now out of garbage collection (gc_pauses.py)
    GET  /openapi.json             the OpenAPI document, generated from the pydantic models (openapi.py)
Every error body has OpenAI's shape (errors.py). docs/api.md documents the fields.

Availability: once the engine has died, or while the server drains for a graceful shutdown
(`app.state.draining`, set by launch.py on SIGTERM), every route but the read-only operational ones
(`ALWAYS_SERVED`, /v1/models/{model}, and GET of stored responses) answers 503 at once, /health included, so load
balancers and supervisors see it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.convertors import Convertor, register_url_convertor
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

import jaxserve
from jaxserve.core.field_types import describe
from jaxserve.engine.engine_load import EngineLoad
from jaxserve.engine.engine_loop import EngineLoop
from jaxserve.engine.memory_usage import MemoryUsage
from jaxserve.engine.request_input import GenerateInput
from jaxserve.model.tokenizer import tokenizer_files_path
from jaxserve.server.auth import APIKeyMiddleware
from jaxserve.server.body_limit import BodySizeLimitMiddleware
from jaxserve.server.engine_client import RequestGroup, preprocess_executor, start_access_record
from jaxserve.server.errors import (
    CLIENT_CLOSED_REQUEST,
    EXCEPTION_HANDLERS,
    APIError,
    error_response,
    parse_json_body,
    unavailable_response,
)
from jaxserve.server.gc_pauses import freeze_gc
from jaxserve.server.metrics import mark_unlogged
from jaxserve.server.native import generate, lora_adapters
from jaxserve.server.openai import chat_completions, models, tokenization
from jaxserve.server.openai.chat_template import load_chat_template
from jaxserve.server.openai.reasoning import reasoning_format
from jaxserve.server.openai.responses import api as responses
from jaxserve.server.openai.tools import get_parser
from jaxserve.server.openapi import openapi_document
from jaxserve.server_args import ServerArgs

access_logger = logging.getLogger("jaxserve.access")

HEALTH_GENERATE_TIMEOUT_S = 60.0
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_QUANT_SUFFIX = re.compile(r"[.-](q\d\w*|iq\d\w*|f16|f32|bf16)$", re.IGNORECASE)
# answered even by a dead or draining server: what an operator reads to find out why
ALWAYS_SERVED = frozenset({"/metrics", "/get_server_info", "/get_model_info", "/server_info", "/model_info", "/v1/models"})
ALWAYS_SERVED_PREFIXES = ("/v1/models/",)  # GET /v1/models/{model}: the card /v1/models lists
# GET /v1/responses/{id} (and .../input_items): the store needs no engine, and a background response
# that finishes while the server drains can still be read
ALWAYS_SERVED_GET_PREFIXES = ("/v1/responses/",)


def is_always_served(method: str, path: str) -> bool:
    """Whether a dead or draining server still answers `method path` (the read-only routes)."""
    return (path in ALWAYS_SERVED or path.startswith(ALWAYS_SERVED_PREFIXES)
            or (method == "GET" and path.startswith(ALWAYS_SERVED_GET_PREFIXES)))


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


class AccessLog:
    """ASGI middleware: one info line per HTTP request once its response is done, as SGLang logs:
    `POST /generate 200 prompt_tokens=6 completion_tokens=4 latency=0.081s` (tokens over every
    prompt and sequence of the request; latency in seconds, to the end of the body). Status 499 for a
    client that left before its reply (errors.CLIENT_CLOSED_REQUEST)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        record = start_access_record()
        status = [0]

        async def send_and_watch(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            code = CLIENT_CLOSED_REQUEST if record.client_gone else status[0] or 500
            access_logger.info(
                "%s %s %d prompt_tokens=%d completion_tokens=%d latency=%.3fs", scope["method"], scope["path"], code,
                record.prompt_tokens, record.completion_tokens, time.perf_counter() - t0,
            )


class AvailabilityGate:
    """ASGI middleware: 503 for every route outside ALWAYS_SERVED once the engine died or while the
    server drains (see the module docstring)."""

    def __init__(self, app: ASGIApp, engine_loop: EngineLoop, state: Any):
        self.app = app
        self.engine_loop = engine_loop
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not is_always_served(scope["method"], scope["path"]):
            if self.engine_loop.error is not None:
                response = unavailable_response(f"the engine has stopped after an error: {self.engine_loop.error}")
                return await response(scope, receive, send)
            if getattr(self.state, "draining", False):
                response = unavailable_response("the server is shutting down", retry_after_s=5)
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


async def health(request: Request) -> Response:
    engine_loop: EngineLoop = request.app.state.engine_loop
    if not engine_loop.is_running:
        return error_response("the engine loop is not running", 503, code="unavailable")
    return JSONResponse({"status": "ok"})


async def health_generate(request: Request) -> Response:
    """Generate one token; 503 when the engine cannot do it within HEALTH_GENERATE_TIMEOUT_S. The probe
    is left out of `--log-requests` and of the sglang:* request metrics (SGLang's log_metrics=False)."""
    engine_loop: EngineLoop = request.app.state.engine_loop
    if not engine_loop.is_running:
        return error_response("the engine loop is not running", 503, code="unavailable")
    group = RequestGroup(engine_loop, is_probe=True)
    group.submit(GenerateInput(engine_loop.engine.checker.tokenize("ping") or [0], {"max_new_tokens": 1, "temperature": 0}))
    mark_unlogged(request, group.rids)  # SGLang's probe is log_metrics=False too
    try:
        outputs = await asyncio.wait_for(group.wait(), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        group.abort()
        return error_response(f"no token generated within {HEALTH_GENERATE_TIMEOUT_S:.0f} s", 503, code="unavailable")
    if (failure := generate.failure_of(outputs[0])) is not None:
        return error_response(failure[1], 503, code="unavailable")
    return JSONResponse({"status": "ok"})


async def get_model_info(request: Request) -> Response:
    engine_loop: EngineLoop = request.app.state.engine_loop
    args = engine_loop.engine.args
    # a path HF-style loaders read (sglang-router loads the tokenizer from it): for a GGUF model, the
    # directory of its converted tokenizer, since neither "default" nor a .gguf file is one
    tokenizer_path = tokenizer_files_path(args.model_path, args.tokenizer_path)
    architecture = engine_loop.engine.runner.model_config.architecture
    return JSONResponse({
        "model_path": engine_loop.engine.runner.model_path,
        "tokenizer_path": tokenizer_path,
        "is_generation": True,
        "served_model_name": request.app.state.model_name,
        "context_length": engine_loop.engine.limits.context_length,
        # as SGLang reports the HF config's: sglang-router reads them when it registers a worker
        "model_type": architecture.removesuffix("ForCausalLM").lower(),
        "architectures": [architecture],
    })


async def get_server_info(request: Request) -> Response:
    """Server args (the API key masked), KV pool usage in tokens, queue sizes, engine counters, and
    `memory`: the weights' and KV pool's bytes (in all and per device) and the process's RSS."""
    engine_loop: EngineLoop = request.app.state.engine_loop
    args = dataclasses.asdict(engine_loop.engine.args)
    if args.get("api_key") or request.app.state.server_args.api_key:
        args["api_key"] = "***"
    args.setdefault("tp_size", 1)  # sglang-router reads tp_size and dp_size when it registers a worker
    # sglang-router 0.3.2 loads a worker's tokenizer from this model_path (HF directory or hub name):
    # for a GGUF model ("default" included) report the directory of its converted tokenizer, which it
    # can read, instead of a name it would try to download; resolved_model_path names the file served
    tokenizer_files = tokenizer_files_path(engine_loop.engine.args.model_path, engine_loop.engine.args.tokenizer_path)
    args["tokenizer_path"] = tokenizer_files
    if engine_loop.engine.runner.model_path.endswith(".gguf") and not tokenizer_files.endswith(".gguf"):
        args["model_path"] = tokenizer_files
    load = engine_loop.load()
    memory, startup = engine_loop.engine.memory_usage(), request.app.state.startup_memory
    info: dict[str, Any] = {
        **args,
        "version": getattr(jaxserve, "__version__", "0.1.0"),
        "served_model_name": request.app.state.model_name,
        "resolved_model_path": engine_loop.engine.runner.model_path,
        "context_length": engine_loop.engine.limits.context_length,
        # SGLang's scheduler get_init_info fields: the pool's capacity in tokens, and the bound a prompt
        # must stay under (it has fewer tokens than this: the context's and the pool's limit)
        "max_total_num_tokens": load.kv_total_tokens,
        "max_req_input_len": engine_loop.engine.limits.max_prompt_tokens,
        "devices": engine_loop.engine.devices,
        "num_running_reqs": load.num_running_reqs,
        "num_waiting_reqs": load.num_waiting_reqs,
        "num_pending_reqs": load.num_pending_reqs,
        "kv_pool": {
            "total_tokens": load.kv_total_tokens,
            "used_tokens": load.kv_used_tokens,
            "cached_tokens": load.kv_cached_tokens,
            "locked_tokens": load.kv_locked_tokens,
            # SGLang's token usage, as the decode log line and /metrics report it: the evictable
            # (unlocked) prefix cache counts as free
            "token_usage": load.snapshot.token_usage if load.snapshot is not None
            else (load.kv_used_tokens - (load.kv_cached_tokens - load.kv_locked_tokens)) / max(1, load.kv_total_tokens),
        },
        "engine_stats": dataclasses.asdict(load.stats),
        "num_step_failures": load.num_step_failures,
        "last_step_time": load.last_step_time,
        "engine_error": engine_loop.error,
        "max_queued_requests": engine_loop.max_queued_requests,
        "num_rejected_requests": {"queue_full": load.num_rejected_queue_full, "queue_timeout": load.num_queue_timeouts},
        # bytes; rss_bytes read now, startup_rss_bytes when the server logged it after start-up
        "memory": {**memory.as_dict(), "startup_rss_bytes": startup.rss_bytes if startup is not None else None},
        "internal_states": [internal_state(load, args.get("speculative_algorithm"), memory)],
    }
    return JSONResponse(info)


def internal_state(load: EngineLoad, speculative_algorithm: str | None, memory: MemoryUsage) -> dict[str, Any]:
    """SGLang's per-DP-rank `internal_states` entry (sglang/srt/managers/scheduler_components/
    internal_state.py), the keys its benchmarks read: `last_gen_throughput` (tokens/s over the last
    decode log interval, as `gen_throughput` on /metrics), `memory_usage` (`MemoryUsage.sglang_memory_usage`:
    weights and KV pool in GiB per device, the pool's capacity in tokens) and, with speculative decoding
    once a draft was verified, `avg_spec_accept_length` (mean tokens per verifying sequence-forward,
    lifetime). From the engine's snapshot; an engine without one reports 0.0 and no accept length."""
    snap = load.snapshot
    state: dict[str, Any] = {
        "last_gen_throughput": float(snap.gen_throughput) if snap is not None else 0.0,
        "memory_usage": memory.sglang_memory_usage(load.kv_total_tokens, load.kv_swa_total_tokens),
    }
    if speculative_algorithm and snap is not None and snap.counters.num_spec_verifications > 0:
        state["avg_spec_accept_length"] = float(snap.spec_accept_length)
    return state


async def get_load(request: Request) -> Response:
    """SGLang's `/get_load` shape: one entry per data-parallel rank of this server (jaxserve has one),
    with SGLang 0.5.23's meanings (scheduler_components/load_inquirer.py `get_loads`): num_reqs counts
    running and waiting requests; num_tokens is the KV tokens requests hold (capacity - free -
    evictable, so a warm prefix cache is no load) plus the waiting queue's tokens; num_pending_tokens
    the tokens still to prefill (the waiting queue's and the chunked request's rest)."""
    load = request.app.state.engine_loop.load()
    held = load.kv_used_tokens - (load.kv_cached_tokens - load.kv_locked_tokens)  # SGLang's num_used_tokens
    return JSONResponse([{
        "dp_rank": 0,
        "num_reqs": load.num_running_reqs + load.num_waiting_reqs,
        "num_waiting_reqs": load.num_waiting_reqs,
        "num_tokens": max(0, held) + load.num_waiting_tokens,
        "num_pending_tokens": load.num_waiting_tokens + load.num_chunked_rest_tokens,
        "ts_tic": time.perf_counter(),
    }])


async def flush_cache(request: Request) -> Response:
    engine_loop: EngineLoop = request.app.state.engine_loop
    try:
        await asyncio.wrap_future(engine_loop.flush_cache())
    except RuntimeError as e:
        return error_response(str(e), 400, code="requests_running")
    return JSONResponse({"success": True, "message": "the prefix cache is empty"})


async def freeze_gc_endpoint(request: Request) -> Response:
    """SGLang's /freeze_gc: the objects alive now leave garbage collection (`gc_pauses.freeze_gc`, with
    --gc-threshold); one process holds the HTTP side and the engine, so this covers both."""
    freeze_gc("/freeze_gc", request.app.state.engine_loop.engine.args.gc_threshold)
    return PlainTextResponse("Garbage collection frozen.\n")


async def abort_request(request: Request) -> Response:
    """{"rid": "..."} -> {"success": whether a running or queued request had that id}.
    {"abort_all": true} (SGLang's `AbortReq` field) aborts every request (rid is then ignored, as
    in SGLang) -> {"success": true, "num_aborted": n}; each ends with finish reason abort."""
    engine_loop: EngineLoop = request.app.state.engine_loop
    body = parse_json_body(await request.body())
    abort_all = body.get("abort_all")
    if abort_all is not None and not isinstance(abort_all, bool):
        raise APIError(f"abort_all: must be a boolean, got {describe(abort_all)}", 400, param="abort_all",
                       code="invalid_type")
    if abort_all:
        num = await asyncio.wrap_future(engine_loop.abort_all("aborted by /abort_request (abort_all)"))
        return JSONResponse({"success": True, "num_aborted": num})
    rid = body.get("rid")
    if not isinstance(rid, str) or not rid:
        raise APIError("rid: a request id (string) is required", 400, param="rid", code="invalid_value")
    return JSONResponse({"success": engine_loop.abort(rid)})


async def openapi_json(request: Request) -> Response:
    return JSONResponse(request.app.state.openapi)


class _StoredResponseId(Convertor):
    """`{response_id:stored_response_id}`: the rest of the path (slashes included) unless it ends in a
    sub-route of a stored response (`/cancel`, `/input_items`)."""

    regex = r"(?:(?!/(?:cancel|input_items)$).)+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("stored_response_id", _StoredResponseId())


def create_app(engine_loop: EngineLoop, server_args: ServerArgs, startup_memory: MemoryUsage | None = None) -> Starlette:
    """The ASGI app over a started `EngineLoop`. `server_args.api_key` turns on bearer-token auth."""
    routes = [
        Route("/generate", generate.generate, methods=["POST"]),
        Route("/v1/completions", chat_completions.completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions.chat_completions, methods=["POST"]),
        Route("/v1/responses", responses.create_response, methods=["POST"]),
        # an id may contain slashes (a request_id is the client's): the route matches the rest of the path,
        # except a sub-route's suffix, so that DELETE .../input_items is that route's 405, not an id's 404
        Route("/v1/responses/{response_id:path}/cancel", responses.cancel_response, methods=["POST"]),
        Route("/v1/responses/{response_id:path}/input_items", responses.list_input_items, methods=["GET"]),
        Route("/v1/responses/{response_id:stored_response_id}", responses.stored_response,
              methods=["GET", "DELETE"]),
        Route("/tokenize", tokenization.tokenize, methods=["POST"]),
        Route("/v1/tokenize", tokenization.tokenize, methods=["POST"]),
        Route("/detokenize", tokenization.detokenize, methods=["POST"]),
        Route("/v1/detokenize", tokenization.detokenize, methods=["POST"]),
        Route("/v1/models", models.models, methods=["GET"]),
        Route("/v1/models/{model:path}", models.retrieve_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/get_model_info", get_model_info, methods=["GET"]),
        Route("/get_server_info", get_server_info, methods=["GET"]),
        Route("/model_info", get_model_info, methods=["GET"]),  # SGLang's current names; the router tries them first
        Route("/server_info", get_server_info, methods=["GET"]),
        Route("/get_load", get_load, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["POST", "GET"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/freeze_gc", freeze_gc_endpoint, methods=["GET", "POST"]),
        Route("/load_lora_adapter", lora_adapters.load_lora_adapter, methods=["POST"]),
        Route("/unload_lora_adapter", lora_adapters.unload_lora_adapter, methods=["POST"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
    ]
    get_parser(server_args.tool_call_parser)  # an unknown --tool-call-parser fails at start-up (ValueError)
    chat_template = load_chat_template(server_args.chat_template)  # so do the two below
    reasoning = reasoning_format(server_args.reasoning_parser)
    model_name = served_model_name(server_args, engine_loop.engine.runner.model_path)
    metrics = None
    if not server_args.disable_metrics and engine_loop.load().snapshot is not None:
        metrics, endpoint = _metrics_endpoint(engine_loop, model_name, server_args.hicache_storage_backend is not None)
        routes.append(Route("/metrics", endpoint, methods=["GET"]))
    # browsers' cross-origin calls, as SGLang allows them (any origin, method and header); outside the API
    # key check, so a preflight needs no key and a 401 still carries the CORS headers
    middleware = [Middleware(CORSMiddleware, allow_origins=["*"], allow_credentials=True, allow_methods=["*"],
                             allow_headers=["*"])]
    if server_args.api_key:
        middleware.append(Middleware(APIKeyMiddleware, api_key=server_args.api_key))
    middleware.append(Middleware(BodySizeLimitMiddleware, max_bytes=server_args.max_request_body_bytes))
    app = Starlette(routes=routes, middleware=middleware, exception_handlers=EXCEPTION_HANDLERS)
    app.add_middleware(AvailabilityGate, engine_loop=engine_loop, state=app.state)
    app.add_middleware(AccessLog)  # outermost: it sees the gate's 503s and the API-key 401s too
    app.state.draining = False
    app.state.preprocess_executor = preprocess_executor()  # its idle thread ends with the process
    app.state.engine_loop = engine_loop
    app.state.server_args = server_args
    app.state.startup_memory = startup_memory  # the reading the start-up log line gave
    app.state.model_name = model_name
    app.state.chat_template = chat_template
    app.state.reasoning_format = reasoning
    app.state.response_store = responses.ResponseStore()
    app.state.background_responses = responses.BackgroundResponses(app.state.response_store)
    app.state.serving_metrics = metrics
    app.state.openapi = openapi_document()
    return app


def _metrics_endpoint(engine_loop: EngineLoop, model_name: str, has_storage_tier: bool):
    """(the ServingMetrics, GET /metrics over the snapshot the engine loop publishes after every step);
    latency histograms observe every output on the loop thread."""
    from jaxserve.server.metrics import CONTENT_TYPE, ServingMetrics

    metrics = ServingMetrics(lambda: engine_loop.load().snapshot, model_name, lambda: engine_loop.load().radix_cache,
                             has_storage_tier=has_storage_tier)
    engine_loop.add_output_observer(metrics.observe)
    metrics.registry.register(_AdmissionCollector(engine_loop, model_name))

    async def endpoint(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return metrics, endpoint


class _AdmissionCollector:
    """`jaxserve_num_rejected_requests_total{reason="queue_full"|"queue_timeout"}`: requests answered
    503 by admission control (--max-queued-requests, --queue-timeout)."""

    def __init__(self, engine_loop: EngineLoop, model_name: str):
        self._engine_loop = engine_loop
        self._model_name = model_name

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        load = self._engine_loop.load()
        family = CounterMetricFamily(
            "jaxserve_num_rejected_requests", "Requests refused with 503 by admission control", labels=["model_name", "reason"]
        )
        family.add_metric([self._model_name, "queue_full"], load.num_rejected_queue_full)
        family.add_metric([self._model_name, "queue_timeout"], load.num_queue_timeouts)
        yield family
