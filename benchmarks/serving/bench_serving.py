"""Benchmark the online serving throughput and latency of an LLM server.

Modelled on SGLang's `python/sglang/bench_serving.py` (same datasets, arrival process, metric
definitions and result block), so numbers are comparable across jaxserve, SGLang, vLLM and any
OpenAI-compatible server. Nothing is downloaded: ShareGPT is read from a local file and the
tokenizer is loaded from local files only.

    python -m benchmarks.serving.bench_serving --backend jaxserve --num-prompts 64 --max-concurrency 8 \
        --dataset-name random --random-input-len 512 --random-output-len 128 --output-file out.jsonl

Token counts prefer what the server reports (meta_info / usage), so totals match the server's own
counters; the local tokenizer (or a word-count estimate without one) is only the fallback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx
import numpy as np
from tqdm import tqdm

from benchmarks.cases import with_case
from benchmarks.serving.bench_backends import (  # noqa: F401 -- re-exported as well
    BACKENDS,
    SSE_DONE,
    Backend,
    NativeStreamParser,
    OpenAIStreamParser,
    RequestFailed,
    RequestSettings,
    StreamChunk,
    parse_sse_line,
)
from benchmarks.serving.bench_datasets import (  # noqa: F401 -- re-exported: tests and other benchmarks read them here
    DatasetRow,
    PromptSampler,
    Tokenizer,
    estimate_num_tokens,
    sample_copy_heavy_requests,
    sample_generated_shared_prefix_requests,
    sample_random_requests,
    sample_sharegpt_requests,
    token_counter,
)

NUM_ERRORS_SHOWN = 5
CASES = Path(__file__).resolve().parent / "cases"


@dataclass
class RequestOutput:
    """The record of one request. Times in seconds; itl has one entry per output token after the
    first (per event for OpenAI-style streams, which do not say how many tokens an event holds)."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    generated_text: str = ""
    finish_reason: str | None = None


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


_REPORTED_FIELDS = ("completion_tokens", "prompt_tokens", "cached_tokens", "finish_reason")


def _merge_reported(last: StreamChunk, chunk: StreamChunk) -> StreamChunk:
    """Keeps the latest reported value of each count: an event that omits one keeps the last."""
    return last._replace(**{k: getattr(chunk, k) for k in _REPORTED_FIELDS if getattr(chunk, k) is not None})


def token_timings(
    start: float, arrivals: Sequence[tuple[float, int]], spreads_itl: bool
) -> tuple[float | None, list[float]]:
    """TTFT and inter-token latencies (seconds) from the events that carried new tokens, given as
    (arrival time, number of new tokens). TTFT is the first arrival minus start. With spreads_itl
    the gap before an event carrying n tokens counts as n gaps of gap / n (SGLang's native backend
    does this); else each event is one gap. TTFT is None if no token arrived."""
    if not arrivals:
        return None, []
    itl: list[float] = []
    for (prev, _), (now, num_new) in zip(arrivals, arrivals[1:]):
        itl.extend([(now - prev) / num_new] * num_new if spreads_itl else [now - prev])
    return arrivals[0][0] - start, itl


async def send_request(
    client: httpx.AsyncClient,
    row: DatasetRow,
    settings: RequestSettings,
    count_tokens: Callable[[str], int] | None,
) -> RequestOutput:
    """Sends one streaming request and times it. Never raises: a failure is recorded in the
    output's error. Counts prefer the server's report; without one, the output is counted with
    count_tokens (the local tokenizer) if given, else from the stream's events."""
    backend = BACKENDS[settings.backend]
    parser = backend.make_parser()
    sends_ids = settings.use_prompt_ids and row.prompt_ids is not None
    out = RequestOutput(prompt_len=len(row.prompt_ids) if sends_ids else row.prompt_len)
    reported = StreamChunk("", 0, None, None, None, None)
    arrivals: list[tuple[float, int]] = []
    start = time.perf_counter()
    try:
        payload = backend.build_payload(row, settings)
        headers = auth_headers(settings.api_key)
        async with client.stream("POST", settings.base_url + backend.path, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                raise RequestFailed(f"HTTP {resp.status_code}: {body[:300]}")
            async for line in resp.aiter_lines():
                data = parse_sse_line(line)
                if data is None:
                    continue
                if data == SSE_DONE:
                    break
                chunk = parser.feed(data)
                if chunk.error is not None:
                    raise RequestFailed(chunk.error)
                reported = _merge_reported(reported, chunk)
                out.generated_text += chunk.text
                if chunk.num_new_tokens > 0:
                    arrivals.append((time.perf_counter(), chunk.num_new_tokens))
        out.latency = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 -- one failed request must not end the run
        out.error = str(e) if isinstance(e, RequestFailed) else f"{type(e).__name__}: {e}"
        return out
    out.success = True
    ttft, out.itl = token_timings(start, arrivals, backend.spreads_itl)
    out.ttft = ttft if ttft is not None else out.latency
    out.finish_reason = reported.finish_reason
    out.cached_tokens = reported.cached_tokens or 0
    if reported.prompt_tokens is not None:
        out.prompt_len = reported.prompt_tokens
    if reported.completion_tokens is not None:
        out.output_len = reported.completion_tokens
    elif count_tokens is not None and out.generated_text:
        out.output_len = count_tokens(out.generated_text)
    else:
        out.output_len = sum(n for _, n in arrivals)
    return out


def poisson_intervals(num_requests: int, request_rate: float, rng: np.random.Generator) -> np.ndarray:
    """Seconds to wait after each request before sending the next: exponential with mean
    1 / request_rate (a Poisson process, as in SGLang); zeros for an infinite rate."""
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    return rng.exponential(1.0 / request_rate, size=num_requests)


async def run_requests(
    rows: Sequence[DatasetRow],
    settings: RequestSettings,
    request_rate: float,
    max_concurrency: int | None,
    rng: np.random.Generator,
    count_tokens: Callable[[str], int] | None,
    show_progress: bool = True,
) -> tuple[list[RequestOutput], float]:
    """Sends rows with Poisson arrivals, at most max_concurrency in flight (arrivals do not wait for
    a slot: requests queue on the limit, as in SGLang). Returns the outputs in row order and the
    wall-clock duration in seconds."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    pbar = tqdm(total=len(rows), disable=not show_progress)
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    # trust_env=False: a proxy from the environment would sit between the benchmark and the server.
    async with httpx.AsyncClient(timeout=httpx.Timeout(6 * 3600, connect=60), limits=limits, trust_env=False) as client:

        async def limited(row: DatasetRow) -> RequestOutput:
            async with limit:
                out = await send_request(client, row, settings, count_tokens)
            pbar.update(1)
            return out

        start = time.perf_counter()
        tasks = []
        waits = poisson_intervals(len(rows), request_rate, rng)
        for i, row in enumerate(rows):
            tasks.append(asyncio.create_task(limited(row)))
            if waits[i] > 0 and i + 1 < len(rows):
                await asyncio.sleep(waits[i])
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    pbar.close()
    return list(outputs), duration


@dataclass(frozen=True)
class BenchmarkMetrics:
    """SGLang's serving metrics. Token totals count successful requests only; latencies in ms;
    throughputs per second of benchmark duration; concurrency = sum of E2E latencies / duration."""

    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    total_cached_tokens: int
    cache_hit_rate: float
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    concurrency: float
    mean_e2e_latency_ms: float
    median_e2e_latency_ms: float
    std_e2e_latency_ms: float
    p90_e2e_latency_ms: float
    p99_e2e_latency_ms: float
    mean_ttft_ms: float
    median_ttft_ms: float
    std_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    std_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    std_itl_ms: float
    p95_itl_ms: float
    p99_itl_ms: float
    max_itl_ms: float


def _stats_ms(values: list[float], percentiles: Sequence[int]) -> list[float]:
    """[mean, median, std, *percentiles] in ms; zeros for an empty list (as SGLang's `x or 0`)."""
    v = np.asarray(values or [0.0], dtype=np.float64) * 1000
    return [float(np.mean(v)), float(np.median(v)), float(np.std(v))] + [
        float(np.percentile(v, p)) for p in percentiles
    ]


def compute_metrics(outputs: Sequence[RequestOutput], duration_s: float) -> BenchmarkMetrics:
    """Metrics from per-request records, with SGLang's definitions: TTFT from request start to the
    first token, TPOT = (latency - TTFT) / (output_len - 1) for requests with more than one output
    token, ITL pooled over all requests' inter-token gaps."""
    ok = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(o.output_len for o in ok)
    total_cached = sum(o.cached_tokens for o in ok)
    latencies = [o.latency for o in ok]
    tpots = [(o.latency - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1]
    itls = [gap for o in ok for gap in o.itl]
    e2e = _stats_ms(latencies, (90, 99))
    ttft = _stats_ms([o.ttft for o in ok], (99,))
    tpot = _stats_ms(tpots, (99,))
    itl = _stats_ms(itls, (95, 99, 100))
    return BenchmarkMetrics(
        len(ok), len(outputs) - len(ok), total_input, total_output, total_cached,
        total_cached / total_input if total_input else 0.0,
        len(ok) / duration_s, total_input / duration_s, total_output / duration_s,
        (total_input + total_output) / duration_s, sum(latencies) / duration_s,
        *e2e, *ttft, *tpot, *itl,
    )


_RESULT_SECTIONS = (
    ("End-to-End Latency", "e2e_latency_ms", "E2E Latency", ("mean", "median", "p90", "p99")),
    ("Time to First Token", "ttft_ms", "TTFT", ("mean", "median", "p99")),
    ("Time per Output Token (excl. 1st token)", "tpot_ms", "TPOT", ("mean", "median", "p99")),
    ("Inter-token Latency", "itl_ms", "ITL", ("mean", "median", "p95", "p99", "max")),
)


def format_result(m: BenchmarkMetrics, backend: str, request_rate: float, max_concurrency: int | None,
                  duration_s: float) -> str:
    """SGLang's result block (plus failed requests and a prefix-cache section)."""
    rows: list[tuple[str, Any]] = [
        ("Backend:", backend),
        ("Traffic request rate:", str(request_rate)),
        ("Max request concurrency:", str(max_concurrency) if max_concurrency else "not set"),
        ("Successful requests:", m.completed),
        ("Failed requests:", m.failed),
        ("Benchmark duration (s):", duration_s),
        ("Total input tokens:", m.total_input_tokens),
        ("Total generated tokens:", m.total_output_tokens),
        ("Request throughput (req/s):", m.request_throughput),
        ("Input token throughput (tok/s):", m.input_throughput),
        ("Output token throughput (tok/s):", m.output_throughput),
        ("Total token throughput (tok/s):", m.total_throughput),
        ("Concurrency:", m.concurrency),
    ]
    for title, suffix, name, stats in _RESULT_SECTIONS:
        rows.append((title, None))
        for stat in stats:
            label = stat.capitalize() if stat in ("mean", "median", "max") else stat.upper()
            rows.append((f"{label} {name} (ms):", getattr(m, f"{stat}_{suffix}")))
    rows += [
        ("Prefix Cache", None),
        ("Total cached tokens:", m.total_cached_tokens),
        ("Cache hit rate:", f"{m.cache_hit_rate:.2%}"),
    ]
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    for name, value in rows:
        if value is None:
            lines.append("{s:{c}^{n}}".format(s=name, n=50, c="-"))
        else:
            lines.append(f"{name:<40} {value:<10.2f}" if isinstance(value, float) else f"{name:<40} {value:<10}")
    lines.append("=" * 50)
    return "\n".join(lines)


def load_tokenizer(path: str) -> Tokenizer:
    """Loads a transformers tokenizer from local files only: an HF directory or name in the local
    cache, or a GGUF file (its embedded tokenizer). Raises on failure."""
    from transformers import AutoTokenizer

    p = Path(path)
    if p.suffix == ".gguf" and p.is_file():
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def get_json(base_url: str, path: str, api_key: str | None) -> dict[str, Any] | None:
    """GET base_url + path as JSON; None if the server does not answer it."""
    try:
        resp = httpx.get(base_url + path, headers=auth_headers(api_key), timeout=30, trust_env=False)
        resp.raise_for_status()
        return resp.json()
    except (httpx.HTTPError, ValueError):
        return None


def resolve_tokenizer(
    args: argparse.Namespace, base_url: str, api_key: str | None, model: str | None
) -> Tokenizer | None:
    """--tokenizer, else the server's /get_model_info tokenizer_path (SGLang, jaxserve), else the
    model name (vLLM, OpenAI). None if none loads: counts then come from the server."""
    candidates = [args.tokenizer] if args.tokenizer else []
    if not candidates:
        info = get_json(base_url, "/get_model_info", api_key) or {}
        candidates = [c for c in (info.get("tokenizer_path"), info.get("model_path"), model) if c]
    for path in dict.fromkeys(candidates):
        try:
            return load_tokenizer(path)
        except Exception as e:  # noqa: BLE001 -- any loader failure means: go on without it
            print(f"Could not load tokenizer {path!r}: {type(e).__name__}: {e}", file=sys.stderr)
    print("No tokenizer: token counts come from the server; prompts are random words.", file=sys.stderr)
    return None


def build_dataset(args: argparse.Namespace, tokenizer: Tokenizer | None, rng: np.random.Generator) -> list[DatasetRow]:
    if args.dataset_name == "random":
        return sample_random_requests(
            PromptSampler(tokenizer, rng), args.num_prompts, args.random_input_len,
            args.random_output_len, args.random_range_ratio,
        )
    if args.dataset_name == "generated-shared-prefix":
        return sample_generated_shared_prefix_requests(
            PromptSampler(tokenizer, rng), args.gsp_num_groups, args.gsp_prompts_per_group,
            args.gsp_system_prompt_len, args.gsp_question_len, args.gsp_output_len,
        )
    if args.dataset_name == "copy-heavy":
        return sample_copy_heavy_requests(tokenizer, rng, args.num_prompts, args.copy_num_sentences, args.copy_output_len)
    if not args.dataset_path:
        raise SystemExit("--dataset-name sharegpt needs --dataset-path (a local ShareGPT JSON file)")
    count = token_counter(tokenizer) or estimate_num_tokens
    return sample_sharegpt_requests(args.dataset_path, args.num_prompts, count, rng, args.sharegpt_output_len)


def _json_safe(value: Any) -> Any:
    """JSON has no inf/nan: write them as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def make_record(args: argparse.Namespace, model: str | None, m: BenchmarkMetrics, duration_s: float,
                outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    """The --output-file line: run settings, all metrics, the args and per-request arrays (SGLang's
    key names). Failed requests have output_len 0 and their error in `errors`."""
    return _json_safe({
        "date": datetime.now().isoformat(timespec="seconds"),
        "backend": args.backend,
        "model": model,
        "dataset_name": args.dataset_name,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "tag": args.tag,
        "duration": duration_s,
        **asdict(m),
        "args": {k: v for k, v in vars(args).items() if k != "api_key"},
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_len if o.success else 0 for o in outputs],
        "cached_tokens": [o.cached_tokens for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "e2e_latencies": [o.latency for o in outputs],
        "itls": [o.itl for o in outputs],
        "finish_reasons": [o.finish_reason for o in outputs],
        "errors": [o.error for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
    })


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=list(BACKENDS), default="jaxserve")
    p.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:30000 (overrides --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model", default=None, help="model name for OpenAI APIs; default: GET /v1/models")
    p.add_argument("--tokenizer", default=None, help="local path; default: the server's /get_model_info")
    p.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    p.add_argument("--dataset-name", choices=["random", "generated-shared-prefix", "sharegpt", "copy-heavy"], default="random")
    p.add_argument("--dataset-path", default=None, help="local ShareGPT JSON file")
    p.add_argument("--num-prompts", type=int, default=1000,
                   help="random and sharegpt; generated-shared-prefix sends groups x prompts-per-group")
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="fixed output length for sharegpt")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--gsp-num-groups", type=int, default=64)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    p.add_argument("--gsp-question-len", type=int, default=128)
    p.add_argument("--gsp-output-len", type=int, default=256)
    p.add_argument("--copy-num-sentences", type=int, default=6, help="copy-heavy: sentences (or functions) per prompt")
    p.add_argument("--copy-output-len", type=int, default=128, help="copy-heavy: max_new_tokens")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tokenize-prompt", action="store_true",
                   help="send prompt token ids (input_ids / a list prompt) instead of text; needs a tokenizer")
    p.add_argument("--disable-ignore-eos", action="store_true", help="do not send ignore_eos")
    p.add_argument("--extra-request-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--warmup-requests", type=int, default=1, help="requests sent (and not measured) first")
    p.add_argument("--flush-cache", action="store_true", help="POST /flush_cache after warm-up (native backends)")
    p.add_argument("--output-file", default=None, help="append one JSON line with the results")
    p.add_argument("--tag", default=None, help="label stored in the output record (plot_bench.py uses it)")
    p.add_argument("--disable-tqdm", action="store_true")
    return p.parse_args(with_case(p, argv, CASES, "benchmarks.serving.bench_serving"))


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    model = args.model
    if model is None:
        models = (get_json(base_url, "/v1/models", api_key) or {}).get("data") or []
        model = models[0]["id"] if models else None
        if model is None and args.backend not in ("jaxserve", "sglang"):
            raise SystemExit("No --model given and GET /v1/models gave none")
    tokenizer = resolve_tokenizer(args, base_url, api_key, model)
    if args.tokenize_prompt and (tokenizer is None or args.backend == "openai-chat"):
        raise SystemExit("--tokenize-prompt needs a tokenizer and a completions or native backend")
    rng = np.random.default_rng(args.seed)
    rows = build_dataset(args, tokenizer, rng)
    if not rows:
        raise SystemExit("The dataset is empty")
    settings = RequestSettings(
        args.backend, base_url, model, api_key, not args.disable_ignore_eos, args.tokenize_prompt,
        json.loads(args.extra_request_body) if args.extra_request_body else {},
    )
    count_tokens = token_counter(tokenizer)

    if args.warmup_requests > 0:
        warm = DatasetRow(rows[0].prompt, rows[0].prompt_len, min(rows[0].output_len, 16), rows[0].prompt_ids)
        print(f"Warming up with {args.warmup_requests} request(s)...")
        warm_outs, _ = await run_requests(
            [warm] * args.warmup_requests, settings, float("inf"), None, rng, count_tokens, show_progress=False
        )
        if not any(o.success for o in warm_outs):
            print(f"Warm-up failed: {warm_outs[0].error}", file=sys.stderr)
    if args.flush_cache and args.backend in ("jaxserve", "sglang"):
        try:
            resp = httpx.post(base_url + "/flush_cache", headers=auth_headers(api_key), timeout=60, trust_env=False)
            resp.raise_for_status()
        except httpx.HTTPError as e:
            print(f"Could not flush the cache: {e}", file=sys.stderr)

    print(f"Benchmarking {len(rows)} requests ({args.dataset_name}) against {base_url} ({args.backend})")
    outputs, duration = await run_requests(
        rows, settings, args.request_rate, args.max_concurrency, rng, count_tokens, not args.disable_tqdm
    )
    metrics = compute_metrics(outputs, duration)
    errors = [o.error for o in outputs if not o.success]
    if errors:
        print(f"{len(errors)} request(s) failed; first errors:")
        for error in errors[:NUM_ERRORS_SHOWN]:
            print(f"  {error}")
    print(format_result(metrics, args.backend, args.request_rate, args.max_concurrency, duration))
    record = make_record(args, model, metrics, duration, outputs)
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps(record) + "\n")
    return record


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark from command-line arguments; returns the output record."""
    return asyncio.run(benchmark(parse_args(argv)))


if __name__ == "__main__":
    main()
