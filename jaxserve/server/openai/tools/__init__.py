"""Tool calling for /v1/chat/completions: the output formats (`parsers`), the prompt that teaches a model
without a tools-aware chat template how to call (`tool_prompt`), the streaming splitter of text and
calls (`streaming`), and how a request uses its tools (`plan`). `--tool-call-parser NAME` picks the format
from `parsers.PARSERS`."""

from jaxserve.server.openai.tools.parsers import PARSERS, ParsedCall, ParseResult, ToolCallParser, get_parser

__all__ = ["PARSERS", "ParsedCall", "ParseResult", "ToolCallParser", "get_parser"]
