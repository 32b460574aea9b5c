"""`python -m jaxserve.server [flags]`: the same as `python scripts/serve.py [flags]`."""

from jaxserve.server.launch import main

if __name__ == "__main__":
    main()
