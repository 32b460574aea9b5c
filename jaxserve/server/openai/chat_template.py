"""`--chat-template`: a Jinja chat template file that replaces the model's own for /v1/chat/completions.

SGLang 0.5.23 (sglang/srt/parser/template_manager.py) takes a built-in template name, a `.jinja` file,
or another file read as its JSON conversation-template format. jaxserve serves the Jinja case: the
file's text becomes the template that transformers' `apply_chat_template` renders (openai/chat_prompt.py), with
a literal backslash-n in the file read as a line break, as SGLang reads it. Any existing file whose name
does not end in `.json` counts as Jinja. SGLang's built-in names (Python conversation templates) and
its `.json` format are refused with a start-up error that says what is accepted. A template that
parses but cannot render the smallest conversation (one user message, with the generation prompt)
would fail every chat request, so it is refused at start-up too; one that fails only for other
conversations (a system message, tools) still starts.
"""

from __future__ import annotations

import os

import jinja2

# the smallest conversation every chat template must render (`check_renders`)
MINIMAL_CONVERSATION = [{"role": "user", "content": "Hello"}]
# tokenizers pass their special tokens as template variables; a template may concatenate them
_SPECIAL_TOKENS = dict.fromkeys(("bos_token", "eos_token", "pad_token", "unk_token"), "")

ACCEPTED = "a path to an existing Jinja chat template file (.jinja, or any other file but .json)"


def load_chat_template(arg: str | None) -> str | None:
    """The template text of `--chat-template ARG` (None without the flag).

    Raises:
        ValueError: ARG is not an existing file (a built-in name included), is a .json conversation
            template, cannot be read as UTF-8 text, is empty or is not valid Jinja; the message names the flag and says
            what is accepted.
    """
    if arg is None:
        return None
    if not os.path.isfile(arg):
        why = "no such file" if not os.path.exists(arg) else "not a file"
        raise ValueError(f"--chat-template {arg}: {why}; SGLang's built-in template names are not served, "
                         f"give {ACCEPTED}")
    if arg.endswith(".json"):
        raise ValueError(f"--chat-template {arg}: SGLang's .json conversation templates are not served; give {ACCEPTED}")
    try:
        with open(arg, encoding="utf-8") as f:
            text = f.read().strip("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template {arg}: cannot be read as text ({e}); give {ACCEPTED}") from None
    if not text.strip():
        raise ValueError(f"--chat-template {arg}: the file is empty; give {ACCEPTED}")
    text = text.replace("\\n", "\n")
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template {arg}: not a valid Jinja template: {e.message} (line {e.lineno})") from None
    check_renders(arg, text)
    return text


def check_renders(arg: str, text: str) -> None:
    """Render `text` once, as transformers' `apply_chat_template` does (its `render_jinja_template`:
    the same sandbox, filters and `raise_exception`), for `MINIMAL_CONVERSATION` with the generation
    prompt, the special tokens as empty strings.

    Raises:
        ValueError: the template raised; the message names the flag and the error.
    """
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        render_jinja_template([MINIMAL_CONVERSATION], chat_template=text, add_generation_prompt=True, **_SPECIAL_TOKENS)
    except Exception as e:  # noqa: BLE001 - any error of the template's own code (UndefinedError, TypeError, ...)
        raise ValueError(f"--chat-template {arg}: cannot render a conversation of one user message with the "
                         f"generation prompt: {type(e).__name__}: {e}") from None
