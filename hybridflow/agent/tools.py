"""Tools: typed Python functions the model may call, each with the JSON schema the chat template is given.

`Tool.from_function(fn)` reads the schema from the signature (types -> JSON types, parameters without a
default are required) and the docstring (its first paragraph describes the tool; `name: text` lines under
`Args:` describe parameters), in the OpenAI function format that Hugging Face chat templates take as
`tools=`. A tool returns anything `str()` can turn into text; its exceptions come back to the model as
`error: ...` text, never stop the rollout. Tools are named in the config by `file.py:function` (or
`module:function`), as reward functions are.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass

from hybridflow.errors import ConfigError

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


class ToolTimeout(Exception):
    """Raised by a tool that enforces its own timeout (and stopped its work): the call counts as timed out."""


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable
    schema: dict
    """{"type": "function", "function": {"name", "description", "parameters"}} (OpenAI / HF format)."""
    kills_on_timeout: bool = False
    """The tool stops its own work at the timeout (the code tool kills its process): the environment
    waits for its answer a little past the timeout instead of abandoning its thread."""

    @classmethod
    def from_function(cls, fn: Callable, name: str | None = None) -> Tool:
        return cls(name or fn.__name__, fn, function_schema(fn, name))

    def check_arguments(self, arguments: dict) -> str:
        """'' when `arguments` fit the schema, else one line the model is answered with."""
        params = self.schema["function"]["parameters"]
        unknown = sorted(set(arguments) - set(params["properties"]))
        missing = [k for k in params["required"] if k not in arguments]
        if unknown or missing:
            return f"{self.name}: unknown arguments {unknown}, missing {missing}"
        for key, value in arguments.items():
            want = params["properties"][key].get("type")
            if want and not _is_json_type(value, want):
                return f"{self.name}: argument {key!r} must be {want}, got {type(value).__name__}"
        return ""


def _is_json_type(value, want: str) -> bool:
    if want == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if want == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    py = {v: k for k, v in _JSON_TYPES.items()}[want]
    return isinstance(value, py)


def function_schema(fn: Callable, name: str | None = None) -> dict:
    """The OpenAI-format schema of `fn` from its signature and docstring."""
    hints = typing.get_type_hints(fn)
    doc = inspect.getdoc(fn) or ""
    described = _arg_descriptions(doc)
    props, required = {}, []
    for pname, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        prop = {}
        json_type = _json_type(hints.get(pname))
        if json_type:
            prop["type"] = json_type
        if pname in described:
            prop["description"] = described[pname]
        props[pname] = prop
        if p.default is p.empty:
            required.append(pname)
    description = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    params = {"type": "object", "properties": props, "required": required}
    return {"type": "function", "function": {"name": name or fn.__name__, "description": description,
                                             "parameters": params}}  # fmt: skip


def _json_type(hint) -> str | None:
    origin = typing.get_origin(hint) or hint
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(hint) if a is not type(None)]  # Optional[X] -> X
        return _json_type(args[0]) if len(args) == 1 else None
    return _JSON_TYPES.get(origin)


def _arg_descriptions(doc: str) -> dict[str, str]:
    """`name: text` / `name (type): text` lines under an `Args:` heading (Google style)."""
    block = re.search(r"^(?:Args|Arguments|Parameters):\s*\n((?:[ \t]+.*\n?)+)", doc, re.M)
    if not block:
        return {}
    found = re.findall(r"^[ \t]+(\w+)(?:\s*\([^)]*\))?:\s*(.+)$", block.group(1), re.M)
    return dict(found)


def load_object(spec: str, key: str):
    """'path/file.py:name' or 'package.module:name' -> the object; ConfigError in one line naming `key`."""
    if ":" not in spec:
        raise ConfigError([f"{key}: {spec!r} is not 'path/to/file.py:name' or 'module:name'"])
    target, name = spec.rsplit(":", 1)
    if target.endswith(".py") or os.sep in target:
        path = os.path.abspath(os.path.expanduser(target))
        if not os.path.isfile(path):
            raise ConfigError([f"{key}: the file {path} does not exist"])
        module_spec = importlib.util.spec_from_file_location(f"hybridflow_user_{abs(hash(path))}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ConfigError([f"{key}: cannot import {target!r}: {e}"]) from None
    obj = getattr(module, name, None)
    if obj is None:
        raise ConfigError([f"{key}: {target} has no {name!r}"])
    return obj


def load_tools(specs: list[str] | tuple[str, ...], key: str = "rollout.multi_turn.tools") -> dict[str, Tool]:
    """Tools by name from `file.py:function` specs (a spec naming a Tool object is taken as it is)."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        obj = load_object(spec, key) if isinstance(spec, str) else spec
        tool = obj if isinstance(obj, Tool) else Tool.from_function(obj)
        if tool.name in tools:
            raise ConfigError([f"{key}: two tools are named {tool.name!r}"])
        tools[tool.name] = tool
    return tools
