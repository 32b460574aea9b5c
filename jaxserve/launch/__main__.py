"""`python -m jaxserve.launch [flags]` (and `python scripts/serve.py [flags]`, which runs this module)."""

import os
import sys

# The server never uses PyTorch (a dev-only dependency, for reference tests), but transformers imports
# it whenever it is installed: ~180 MB of RSS. Hiding it keeps a dev install's server as lean as a
# user's (importlib finds no module whose sys.modules entry is None, so transformers runs torch-free).
# It must happen before anything imports transformers, so before jaxserve.launch.cli.
sys.modules.setdefault("torch", None)
# transformers then advises "PyTorch was not found. Models won't be available..." on every start; the
# server needs none of its models (tokenizers, configs and templates only), so the advice only alarms.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from jaxserve.launch.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
