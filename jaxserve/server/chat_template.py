"""`--chat-template`: a Jinja chat template file that replaces the model's own for /v1/chat/completions.

SGLang 0.5.23 (sglang/srt/parser/template_manager.py) takes a built-in template name, a `.jinja` file,
or another file read as its JSON conversation-template format. jaxserve serves the Jinja case: the
file's text becomes the template that transformers' `apply_chat_template` renders (chat_prompt.py), with
a literal backslash-n in the file read as a line break, as SGLang reads it. Any existing file whose name
does not end in `.json` counts as Jinja. SGLang's built-in names (Python conversation templates) and
its `.json` format are refused with a start-up error that says what is accepted.
"""

from __future__ import annotations

import os

import jinja2

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
    return text
