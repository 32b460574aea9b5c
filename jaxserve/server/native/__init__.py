"""SGLang's native API (POST /generate) and its request schema as data."""
