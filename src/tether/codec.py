"""JSON codec for task arguments and results (jsonb columns). Never pickle: decoding
builds only plain data and the stdlib types in _DECODERS, and no tag names a module or
class, so a row can never make a worker import or call anything. Dataclasses and pydantic
models come back as dicts; decode_as rebuilds them from a hint in the worker's own code.
"""

from __future__ import annotations

import base64
import functools
import inspect
import json
import json.encoder
import math
import re
import threading
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from enum import Enum
from typing import Any, ForwardRef
from uuid import UUID

from pydantic import BaseModel, PydanticUserError, TypeAdapter, ValidationError

from tether.errors import SerializationError
from tether.result import TaskError, TaskResult

__all__ = ["decode", "decode_as", "decode_result", "dumps", "encode_result", "loads", "result_from_decoded"]

# Non-JSON scalars are stored as {"__tether__": <tag>, "v": <json>}. A user dict with a
# "__tether__" key is escaped as tag "dict" with a list of [key, value] pairs: object_hook
# runs bottom-up, so the escaped dict must not itself look like a tagged object.
_TAG = "__tether__"
_TAG_KEY = '"__tether__":'  # a tag (or a user key to escape) in compact output
# json.dumps silently turns int/float/bool/None keys into strings (back as str keys). They
# look like this in the output; a hit (or a str key like "42") sends dumps to the slow walk.
_CONVERTED_KEY = re.compile(r'"(?:-?\d[-+.\deE]*|true|false|null)":')
_NO_NAN = "cannot be stored (jsonb has no NaN or Infinity); send None, a string or a Decimal"
_NO_KEY = "not a str; JSON keys are strings: convert keys with str() or send a list of pairs"


def _unstorable(s: str) -> str | None:
    """Why PostgreSQL cannot store the string `s` in jsonb or text, or None if it can."""
    if "\x00" in s:
        return "it contains a NUL character (\\x00), which PostgreSQL cannot store; remove it or send bytes"
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            return (
                f"it contains {s[e.start]!r} at index {e.start}, a lone surrogate that is not "
                "valid UTF-8 (PostgreSQL cannot store it)"
            )
    return None


def _maybe_unstorable(text: str) -> bool:
    """A cheap look at encoded JSON text: might a string in it be unstorable? (The walk decides.)"""
    if "\\u0000" in text:  # also an escaped backslash followed by u0000: a false alarm, rare
        return True
    return not text.isascii() and _unstorable(text) is not None


class _Refused(Exception):
    """A value the codec will not encode; the slow walk adds `what` and the path."""


def _type_name(o: object) -> str:
    t = type(o)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


# (type, tag, how to write "v"), in order: datetime is a date subclass.
_TAGGERS: tuple[tuple[Any, str, Callable[[Any], Any]], ...] = (
    (datetime, "datetime", datetime.isoformat),  # keeps the UTC offset
    (date, "date", date.isoformat),
    (time, "time", time.isoformat),
    (timedelta, "timedelta", lambda o: [o.days, o.seconds, o.microseconds]),  # exact
    (UUID, "uuid", str),
    (Decimal, "decimal", str),  # a string: a JSON number would be read back via float
    (bytes | bytearray, "bytes", lambda o: base64.b64encode(o).decode("ascii")),
)


def _tag(o: object) -> dict[str, Any] | None:
    """The tagged form of a supported non-JSON scalar, or None if `o` is not one."""
    if isinstance(o, datetime) and o.utcoffset() is None:
        raise _Refused(
            f"naive datetime {o!r} (no tzinfo): tether will not guess its time zone; give "
            "it a tzinfo, e.g. datetime.now(timezone.utc) or dt.replace(tzinfo=timezone.utc)"
        )
    for kind, tag, write in _TAGGERS:
        if isinstance(o, kind):
            return {_TAG: tag, "v": write(o)}
    return None


def _expand(o: object) -> Any:
    """Turn a supported object into data to encode further, or refuse it."""
    if isinstance(o, Enum):
        return o.value
    if isinstance(o, BaseModel):
        return o.model_dump(mode="python", by_alias=True)  # by alias: validation reads those
    if is_dataclass(o) and not isinstance(o, type):
        # Shallow on purpose (not asdict): nested values go through this codec again.
        return {f.name: getattr(o, f.name) for f in fields(o)}
    if isinstance(o, set | frozenset):
        try:
            return sorted(o)  # equal sets give equal text
        except TypeError:
            return list(o)
    code = " (tether never sends code, only data)" if callable(o) else ""
    raise _Refused(
        f"type {_type_name(o)} is not supported{code}; send JSON types (str, int, float, bool, "
        "None, list, dict), datetime, date, time, timedelta, UUID, Decimal, bytes, Enum, "
        "a dataclass or a pydantic model instead"
    )


# Tags _default wrote in this thread during the current dumps: they let dumps tell our tags
# from user "__tether__" keys (which need escaping) in the text, without encoding twice.
class _Count(threading.local):
    tags = 0


_count = _Count()


def _default(o: object) -> Any:
    tagged = _tag(o)
    if tagged is None:
        return _expand(o)
    _count.tags += 1
    return tagged


# json.dumps builds a JSONEncoder and closures per call; a C encoder made once is several
# times faster. markers=None keeps it stateless, so threads share it (a cycle: RecursionError).
# Arguments: markers, default, encoder, indent, separators, sort_keys, skipkeys, allow_nan.
_encode = json.encoder.c_make_encoder(  # type: ignore[attr-defined]
    None, _default, json.encoder.encode_basestring, None, ":", ",", False, False, False
)


def dumps(value: Any, *, what: str = "value") -> str:
    """Encode `value` as compact JSON text; SerializationError names `what` and the path."""
    outer = _count.tags  # a dumps nested in a user's serializer keeps its count apart
    _count.tags = 0
    try:
        text: str | None = "".join(_encode(value, 0))
        tags = _count.tags
    except Exception:  # any failure: the slow walk explains it precisely, with a path
        text, tags = None, 0
    finally:
        _count.tags = outer
    if text is None or text.count(_TAG_KEY) != tags or _CONVERTED_KEY.search(text) or _maybe_unstorable(text):
        return _slow(value, what)
    return text


def _slow(value: Any, what: str) -> str:
    try:
        return "".join(_encode(_walk(value, "", what), 0))  # plain data: no _default calls
    except SerializationError:
        raise
    except (RecursionError, ValueError) as e:  # too deep or cyclic; an int too long to print
        problem = "nested too deeply, or a reference cycle" if isinstance(e, RecursionError) else e
        raise SerializationError(f"cannot serialise {what}: {problem}") from None


def _fail(what: str, path: str, problem: str) -> SerializationError:
    return SerializationError(f"cannot serialise {what}{' at ' + path if path else ''}: {problem}")


def _walk(o: Any, path: str, what: str) -> Any:
    """Convert `o` to plain JSON data (tags and escapes applied), tracking the path."""
    if isinstance(o, str):  # StrEnum included
        problem = _unstorable(o)
        if problem:
            raise _fail(what, path, f"the string {o!r:.80}: {problem}")
        return o
    if o is None or isinstance(o, int):  # bool and IntEnum included
        return o
    if isinstance(o, float):
        if math.isfinite(o):
            return o
        raise _fail(what, path, f"the float {o!r} {_NO_NAN}")
    if isinstance(o, dict):
        out: dict[str, Any] = {}
        for k, v in o.items():
            if not isinstance(k, str):
                raise _fail(what, path, f"dict key {k!r} ({_type_name(k)}) is {_NO_KEY}")
            problem = _unstorable(k)
            if problem:
                raise _fail(what, path, f"dict key {k!r:.80}: {problem}")
            out[k] = _walk(v, f"{path}[{k!r}]", what)
        return {_TAG: "dict", "v": [[k, v] for k, v in out.items()]} if _TAG in out else out
    if isinstance(o, list | tuple):
        return [_walk(v, f"{path}[{i}]", what) for i, v in enumerate(o)]
    try:
        tagged = _tag(o)
        expanded = _expand(o) if tagged is None else None
    except _Refused as e:
        raise _fail(what, path, str(e)) from None
    except Exception as e:  # e.g. a pydantic serializer of the user's that raised
        raise _fail(what, path, f"converting {_type_name(o)} failed: {e!r}") from e
    return tagged if tagged is not None else _walk(expanded, path, what)


# Every tag there is: the type "v" must have, and a constructor of a stdlib type.
# Nothing is looked up by name; hostile "v" values can only raise.
_DECODERS: dict[str, tuple[type, Callable[[Any], Any]]] = {
    "datetime": (str, datetime.fromisoformat),
    "date": (str, date.fromisoformat),
    "time": (str, time.fromisoformat),
    "timedelta": (list, lambda v: timedelta(*v)),  # [days, seconds, microseconds]
    "uuid": (str, UUID),
    "decimal": (str, Decimal),
    "bytes": (str, lambda v: base64.b64decode(v, validate=True)),
    "dict": (list, dict),  # [[key, value], ...]
}


def _hook(d: dict[str, Any]) -> Any:
    if _TAG not in d:
        return d
    tag = d[_TAG]
    decoder = _DECODERS.get(tag) if isinstance(tag, str) else None
    if decoder is None or len(d) != 2 or "v" not in d:  # not written by tether: refused
        what = "unknown tag" if decoder is None else "malformed tagged value"
        raise SerializationError(f"cannot decode: {what} {tag!r} in {d!r:.200}")
    kind, make = decoder
    try:
        if not isinstance(d["v"], kind):
            raise TypeError(f"expected {kind.__name__}")
        return make(d["v"])
    except (ValueError, TypeError, ArithmeticError) as e:  # Decimal raises InvalidOperation
        raise SerializationError(f"cannot decode {tag!r} value {d['v']!r:.200}: {e}") from None


def _no_constant(name: str) -> Any:
    raise SerializationError(f"cannot decode: {name} is not valid JSON (nor storable in jsonb)")


# Built once: json.loads with any keyword argument builds a new decoder per call.
_PLAIN_DECODER = json.JSONDecoder(parse_constant=_no_constant)
_TAG_DECODER = json.JSONDecoder(parse_constant=_no_constant, object_hook=_hook)


def loads(text: str | bytes) -> Any:
    """Parse JSON text written by `dumps` (or by jsonb) and restore tagged values."""
    try:
        text = text.decode("utf-8") if isinstance(text, bytes | bytearray) else text
        # No tag anywhere (the common case): no Python call per object.
        decoder = _TAG_DECODER if '"__tether__"' in text else _PLAIN_DECODER
        return decoder.decode(text)
    except SerializationError:
        raise
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise SerializationError(f"cannot decode: not valid JSON: {e}") from None


def decode(obj: Any) -> Any:
    """Restore tagged values in data already parsed from jsonb (e.g. by psycopg). Once only."""
    if isinstance(obj, dict):
        return _hook({k: decode(v) for k, v in obj.items()})  # bottom-up, as json.loads
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    return obj


@functools.lru_cache(maxsize=1024)
def _adapter(hint: Any) -> TypeAdapter[Any]:
    return TypeAdapter(hint)


def decode_as(value: Any, hint: Any, *, what: str = "value") -> Any:
    """Validate a decoded value into `hint`, a type from the worker's code (never the row's)."""
    if hint is inspect.Parameter.empty or hint is Any or hint is None or hint is type(None):
        return value
    if isinstance(hint, str | ForwardRef):
        raise SerializationError(
            f"cannot decode {what}: the hint {hint!r} is an unresolved string annotation; "
            "resolve annotations first (inspect.signature(fn, eval_str=True))"
        )
    name = hint.__qualname__ if isinstance(hint, type) else repr(hint)
    try:
        try:
            adapter = _adapter(hint)
        except TypeError:  # an unhashable hint (e.g. Annotated with a list): not cached
            adapter = TypeAdapter(hint)
        return adapter.validate_python(value)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'value'}: {err['msg']}"
            for err in e.errors(include_url=False)[:5]
        )
        raise SerializationError(f"cannot decode {what} as {name}: {problems}") from None
    except PydanticUserError as e:  # raised when building the adapter
        raise SerializationError(f"cannot decode {what}: {name} is not a type: {e}") from None


def encode_result(result: TaskResult[Any, Any], *, what: str = "result") -> str:
    """Encode as `{"ok": value}` or `{"err": {"code": .., "message": .., "data": ..}}`."""
    if not isinstance(result, TaskResult):
        raise SerializationError(f"cannot serialise {what}: not a TaskResult: {_type_name(result)}")
    err = result.err
    if err is None:
        return '{"ok":' + dumps(result.ok, what=what) + "}"
    head = dumps({"code": str(err.code), "message": str(err.message)}, what=f"{what} error")
    data = dumps(err.data, what=f"{what} error data")
    return '{"err":' + head[:-1] + ',"data":' + data + "}}"


def decode_result(obj: Any) -> TaskResult[Any, TaskError]:
    """Decode a stored result, given as JSON text or as data parsed from jsonb."""
    return result_from_decoded(loads(obj) if isinstance(obj, str | bytes) else decode(obj))


def result_from_decoded(data: Any) -> TaskResult[Any, TaskError]:
    """A TaskResult from a stored result already decoded by loads/decode (tags restored)."""
    if isinstance(data, dict) and len(data) == 1:
        if "ok" in data:
            return TaskResult(ok=data["ok"])
        err = data.get("err")
        if isinstance(err, dict) and isinstance(err.get("code"), str) and err["code"]:
            message, extra = str(err.get("message", "")), err.get("data")
            return TaskResult(err=TaskError(err["code"], message, extra))
    raise SerializationError(f"cannot decode result: not a stored task result: {data!r:.200}")
