"""The shared data types every layer may import (docs/architecture.md, "Who may import whom"): a request on
the host (`request.Req`, `FinishReason`), its sampling params and their checks (`sampling_params`), the
JSON type and size tables of request fields (`field_types`, `size_limits`), the request errors (`errors`)
and the host-side batch entry the runner takes (`batch`). Nothing here imports another jaxserve package."""
