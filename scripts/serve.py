"""Serve an LLM with jaxserve: SGLang's native API and the OpenAI API over HTTP.

    python scripts/serve.py                                   # SmolLM2-135M-Instruct on 127.0.0.1:30000
    python scripts/serve.py --model-path /path/to/hf_dir --port 8000 --api-key secret
    python scripts/serve.py --help                            # every flag (generated from ServerArgs)

Start-up shows the model loading and the compilation of the shape buckets, then one line:
`jaxserve ready: serving <model> at http://<host>:<port> (OpenAI API at /v1)`. docs/api.md lists
the endpoints.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("jaxserve.launch", run_name="__main__")  # its __main__ hides torch, then serves
