"""SGLang's default reading of a JSON schema for constrained decoding: properties and items the schema
does not name are not generated.

JSON Schema lets an object have any property its `properties` does not list unless
`additionalProperties` says otherwise. SGLang 0.5.23's default grammar backend, xgrammar 0.2.7,
compiles schemas with `strict_mode=True` (the default of `GrammarCompiler.compile_json_schema`, which
SGLang does not override), which its documentation defines as `unevaluatedProperties` and
`unevaluatedItems` being false where a schema does not set them. Checked against xgrammar 0.2.7 itself:

- an object schema that lists `properties` (or `required`) and sets neither `additionalProperties`
  nor `unevaluatedProperties` accepts no other key: `{"properties": {"a": ...}}` refuses
  `{"a": 1, "b": 2}`; the same holds inside `items`, `anyOf`, `oneOf`, `$defs` and `properties`;
- a bare `{"type": "object"}` (no object keyword) stays any object, and `{"type": "array"}` any array
  (so `response_format` `json_object`, which becomes `{"type": "object"}`, is unchanged);
- an array with `prefixItems` and neither `items` nor `unevaluatedItems` has no further items;
- `allOf` is not closed (xgrammar only warns that it is unsupported; closing each part would make
  their intersection refuse the other parts' properties).

OpenAI's `strict: true` asks for the same closed objects (it requires `additionalProperties: false`
on every object); SGLang constrains a `json_schema` response format whatever `strict` says, and so
does jaxserve. llguidance, the backend jaxserve uses, follows JSON Schema's open default, so
`close_unnamed` rewrites a schema into the closed one before llguidance compiles it.
"""

from __future__ import annotations

from typing import Any

# keywords whose value is one subschema / a list of them / a name -> subschema map
_ONE = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "contains", "propertyNames")
_LIST = ("prefixItems", "anyOf", "oneOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


def close_unnamed(schema: Any) -> Any:
    """`schema` (a parsed JSON schema) with `additionalProperties: false` on each object schema that
    lists `properties` or `required` and sets neither `additionalProperties` nor
    `unevaluatedProperties`, and `items: false` on each array schema with `prefixItems` and neither
    `items` nor `unevaluatedItems` (xgrammar's strict mode, the module docstring). A new schema is
    returned; `schema` is not changed. `allOf` parts (and the schema holding them), `not`,
    `if`/`then`/`else` and boolean schemas are left as they are."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            out[key] = close_unnamed(schema[key])
    for key in _LIST:
        if isinstance(schema.get(key), list):
            out[key] = [close_unnamed(s) for s in schema[key]]
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            out[key] = {name: close_unnamed(s) for name, s in schema[key].items()}
    if "allOf" in schema:
        return out
    if ("properties" in schema or "required" in schema) and not (
            "additionalProperties" in schema or "unevaluatedProperties" in schema):
        out["additionalProperties"] = False
    if "prefixItems" in schema and not ("items" in schema or "unevaluatedItems" in schema):
        out["items"] = False
    return out
