"""A request's checks against the model, run once per request before it reaches the scheduler
(`RequestChecker.check`, check.py) on every path: the server's (`EngineLoop.submit`, in the caller's
thread) and research code's (`Engine.add_request`). The model's bounds are one value (`ModelLimits`,
limits.py: vocabulary, context, KV pool, loaded adapters); SGLang's rule for `logprob_start_len` is
logprob_start.py. What the request carries is checked where it is parsed: the sampling fields' JSON types
by `SamplingParams.from_dict` (or an OpenAI route's body), their values by `SamplingParams.validate`, which
`check` calls (core/). Every refusal is a `RequestError` naming its field, the server's 400."""
