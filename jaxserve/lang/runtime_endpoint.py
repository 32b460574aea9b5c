"""RuntimeEndpoint: run programs against a server with SGLang's native API (jaxserve or SGLang).

    backend = RuntimeEndpoint("http://127.0.0.1:30000", api_key=None)
    state = program.run(backend=backend)

Requests: POST /generate (text in, text out; `stream` for SSE), and for `select` one batched POST
/generate of token ids with `return_logprob` and `logprob_start_len`. GET /get_model_info at start.

The tokenizer (select tokenizes choices on the client; roles need the chat template) comes from, in
order: `tokenizer=` (a transformers tokenizer or a path), else the server's `tokenizer_path` /
`model_path` from /get_model_info when that path exists on this machine (true for a local jaxserve
server). A remote server's model is not on this machine: pass `tokenizer=` (and, for roles, the
tokenizer's template is used unless `chat_template=` overrides it). A program that uses neither
select nor roles never loads a tokenizer.

Errors: an HTTP 4xx/5xx raises BackendError with the server's message (`error.message` of an
OpenAI-shaped body, as jaxserve and SGLang send), a transport failure raises BackendError(503).
"""

from __future__ import annotations

import json
import os
import re
import threading
from typing import Any, Iterator

import httpx

from jaxserve.lang.backend import SCORING_MAX_NEW_TOKENS, Backend, GenChunk, GenResult, split_request_fields
from jaxserve.lang.chat_template import ChatTemplate
from jaxserve.lang.errors import BackendError

DEFAULT_TIMEOUT_S = 600.0


class RuntimeEndpoint(Backend):
    """HTTP backend (see the module docstring).

    Args:
        base_url: e.g. "http://127.0.0.1:30000".
        api_key: sent as `Authorization: Bearer <key>`.
        tokenizer: a transformers tokenizer, or a path `load_tokenizer` accepts (HF directory, .gguf).
        chat_template: overrides the template derived from the tokenizer.
        timeout: seconds per request (generation included).
        transport: an httpx transport (tests use `httpx.MockTransport`).

    Raises:
        BackendError: the server is unreachable or /get_model_info fails.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        tokenizer: Any = None,
        chat_template: ChatTemplate | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ):
        super().__init__(chat_template)
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, transport=transport)
        self._tokenizer_arg = tokenizer
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self._caches_prefixes: bool | None = None
        self.model_info: dict[str, Any] = self._request("GET", "/get_model_info")

    # ---- model facts ----------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = self._load_tokenizer()
            return self._tokenizer

    def _load_tokenizer(self) -> Any:
        from jaxserve.model.tokenizer import load_tokenizer

        arg = self._tokenizer_arg
        if arg is not None and not isinstance(arg, (str, os.PathLike)):
            return arg
        path = str(arg) if arg is not None else self.model_info.get("tokenizer_path") or self.model_info.get("model_path")
        if not path or not os.path.exists(path):
            raise BackendError(
                404,
                f"the server's tokenizer {path!r} is not on this machine; pass RuntimeEndpoint(..., tokenizer=PATH) "
                "(select and roles need the tokenizer)",
            )
        return load_tokenizer(path)

    @property
    def caches_prefixes(self) -> bool:
        """From /get_server_info's `disable_radix_cache` (assumed on when the server does not say)."""
        if self._caches_prefixes is None:
            try:
                info = self._request("GET", "/get_server_info")
                self._caches_prefixes = not info.get("disable_radix_cache", False)
            except BackendError:
                self._caches_prefixes = True
        return self._caches_prefixes

    def get_server_info(self) -> dict[str, Any]:
        return self._request("GET", "/get_server_info")

    def flush_cache(self) -> None:
        """Empty the server's prefix cache (the server refuses while requests run)."""
        self._request("POST", "/flush_cache")

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, prompt: str, params: dict[str, Any]) -> GenResult:
        params, fields = split_request_fields(params)
        obj = self._request("POST", "/generate", {"text": prompt, "sampling_params": params, **fields})
        return GenResult(obj["text"], list(obj.get("output_ids") or []), obj.get("meta_info") or {})

    def generate_stream(self, prompt: str, params: dict[str, Any]) -> Iterator[GenChunk]:
        params, fields = split_request_fields(params)
        body = {"text": prompt, "sampling_params": params, "stream": True, **fields}
        text, last = "", None
        try:
            with self._client.stream("POST", "/generate", json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    _raise_for_status(response)
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[len("data:"):].strip()
                    if payload == "[DONE]":
                        break
                    obj = json.loads(payload)
                    if "error" in obj:
                        raise _error_of(obj, 500)
                    delta, text, last = obj["text"][len(text):], obj["text"], obj
                    if delta:
                        yield GenChunk(delta)
        except httpx.HTTPError as e:
            raise BackendError(503, f"{type(e).__name__}: {e}") from e
        if last is None:
            raise BackendError(502, "the stream ended before any output")
        yield GenChunk("", GenResult(text, list(last.get("output_ids") or []), last.get("meta_info") or {}))

    def prompt_logprobs(self, input_ids: list[list[int]], logprob_start_len: int) -> list[list[float | None]]:
        body = {
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": SCORING_MAX_NEW_TOKENS, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": logprob_start_len,
        }
        objs = self._request("POST", "/generate", body)
        if isinstance(objs, dict):
            objs = [objs]
        # Entries are [logprob, token_id, text]; SGLang and jaxserve both return them from
        # logprob_start_len on (choices.py reads them from the end, whatever the first one is).
        return [[entry[0] for entry in (obj.get("meta_info") or {}).get("input_token_logprobs") or []] for obj in objs]

    def cache_prefix(self, prompt: str) -> None:
        self._request("POST", "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": SCORING_MAX_NEW_TOKENS, "temperature": 0}})

    # ---- plumbing -------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            response = self._client.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise BackendError(503, f"{method} {self.base_url}{path} failed: {type(e).__name__}: {e}") from e
        _raise_for_status(response)
        try:
            return response.json()
        except ValueError as e:
            raise BackendError(502, f"{method} {path} returned a body that is not JSON: {response.text[:200]!r}") from e

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "RuntimeEndpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _raise_for_status(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        body = response.json()
    except ValueError:
        raise BackendError(response.status_code, response.text.strip() or response.reason_phrase) from None
    raise _error_of(body, response.status_code)


def _gen_argument(param: Any) -> Any:
    """The program's name for a field /generate names: jaxserve says `sampling_params.regex` (SGLang's
    request layout), the program passed `gen(regex=...)`, and the in-process backend says `regex`."""
    if isinstance(param, str):
        return re.sub(r"^sampling_params(\[\d+\])?\.", "", param)
    return param


def _error_of(body: Any, status_code: int) -> BackendError:
    """BackendError from an error body: OpenAI's {"error": {...}}, {"message": ...}, or anything."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            message = err.get("message") or err.get("detail") or json.dumps(body)
            code = err.get("code")
            status = code if isinstance(code, int) and 400 <= code < 600 else status_code
            return BackendError(status, str(message), param=_gen_argument(err.get("param")))
        return BackendError(status_code, str(err))
    return BackendError(status_code, json.dumps(body))
