"""Unit tests for tether.codec: round trips, refusals, hostile payloads, results."""

from __future__ import annotations

import json
import math
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from enum import Enum, IntEnum, StrEnum
from inspect import Parameter
from typing import Annotated, Any
from uuid import UUID

import pytest
from pydantic import BaseModel, Field

from tether.codec import decode, decode_as, decode_result, dumps, encode_result, loads
from tether.errors import SerializationError
from tether.result import ErrorCode, TaskError, TaskResult

IST = timezone(timedelta(hours=5, minutes=30))
NYC = timezone(timedelta(hours=-5))
AWARE = datetime(2024, 3, 1, 12, 30, 45, 123456, tzinfo=IST)
U = UUID("12345678-1234-5678-1234-567812345678")
WHAT = "argument 'x' of task 't'"


class Color(Enum):
    RED = "red"
    PAIR = (1, 2)


class Level(IntEnum):
    HIGH = 3


class Mode(StrEnum):
    FAST = "fast"


@dataclass
class Point:
    x: int
    when: datetime
    tags: list[str] = field(default_factory=list)


class Item(BaseModel):
    id: UUID
    price: Decimal
    at: datetime
    point: Point | None = None


class Aliased(BaseModel):
    user_id: int = Field(alias="userId")
    seen: datetime


@dataclass
class Basket:
    items: list[Item]
    note: str = ""


def roundtrip(value: Any) -> Any:
    """Decode both ways the codec is used: from text, and from psycopg-parsed jsonb."""
    text = dumps(value)
    via_text = loads(text)
    via_obj = decode(json.loads(text))
    assert via_text == via_obj
    return via_text


# ---- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        False,
        0,
        -7,
        2**80,
        1.5,
        -0.0,
        1e300,
        "",
        'héllo ✓ "quoted" \\ \n',
        "a literal backslash-u0000: \\u0000",
        [],
        {},
        [1, [2, [3, {"a": None}]]],
        {"k": {"j": [True, 1.25, "s"]}},
        {"42": "numeric-looking str key", "null": 1, "true": 2, "-1.5e3": 3},
        AWARE,
        datetime(2024, 1, 1, tzinfo=UTC),
        datetime(1999, 12, 31, 23, 59, 59, tzinfo=NYC),
        datetime(2024, 1, 1, tzinfo=timezone(timedelta(hours=5, seconds=7))),
        date(2024, 2, 29),
        time(8, 15),
        time(8, 15, 30, 5, tzinfo=UTC),
        timedelta(0),
        timedelta(days=-3, seconds=5, microseconds=7),
        timedelta(days=999_999_999),
        U,
        Decimal("0.1"),
        Decimal("-1.23E+5"),
        Decimal("123456789012345678901234567890.000000000000000001"),
        b"",
        b"\x00\xff binary \n",
        [AWARE, U, Decimal("0.1"), b"x", date(2020, 1, 1), timedelta(seconds=1)],
        {"when": AWARE, "ids": [U, U], "nested": {"price": Decimal("9.99"), "raw": b"\x01"}},
        [{"events": [{"at": AWARE}, {"at": datetime(2020, 5, 5, tzinfo=UTC)}]}],
    ],
)
def test_round_trip(value: Any) -> None:
    back = roundtrip(value)
    assert back == value
    assert type(back) is type(value)


def test_aware_datetime_keeps_its_offset() -> None:
    back = roundtrip({"at": AWARE})["at"]
    assert back == AWARE
    assert back.utcoffset() == timedelta(hours=5, minutes=30)
    assert back.isoformat() == AWARE.isoformat()


def test_decimal_is_exact() -> None:
    back = roundtrip([Decimal("0.1")])[0]
    assert isinstance(back, Decimal)
    assert str(back) == "0.1"
    assert back + Decimal("0.2") == Decimal("0.3")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ((1, 2, (3,)), [1, 2, [3]]),
        ({3, 1, 2}, [1, 2, 3]),
        (frozenset({"b", "a"}), ["a", "b"]),
        ({"t": (AWARE, U)}, {"t": [AWARE, U]}),
        (bytearray(b"ab"), b"ab"),
        (Color.RED, "red"),
        (Color.PAIR, [1, 2]),
        (Level.HIGH, 3),
        (Mode.FAST, "fast"),
        ({"m": Mode.FAST, "l": [Level.HIGH]}, {"m": "fast", "l": [3]}),
    ],
)
def test_lossy_but_documented_forms(value: Any, expected: Any) -> None:
    assert roundtrip(value) == expected


def test_unsortable_set_is_a_list_of_its_items() -> None:
    back = roundtrip({1, "a"})
    assert sorted(back, key=str) == [1, "a"]


def test_output_is_compact_and_not_ascii_escaped() -> None:
    assert dumps([42, {"width": 640}]) == '[42,{"width":640}]'
    assert dumps("é✓") == '"é✓"'
    assert dumps(U) == '{"__tether__":"uuid","v":"12345678-1234-5678-1234-567812345678"}'


# ---- dataclasses and pydantic models -------------------------------------------------------

POINT = Point(3, AWARE, ["a", "b"])
ITEM = Item(id=U, price=Decimal("0.1"), at=AWARE, point=POINT)


@pytest.mark.parametrize(
    ("value", "hint"),
    [
        (POINT, Point),
        (ITEM, Item),
        ([POINT, Point(4, AWARE)], list[Point]),
        ([ITEM, Item(id=U, price=Decimal("2"), at=AWARE)], list[Item]),
        ({"a": ITEM}, dict[str, Item]),
        (Basket(items=[ITEM], note="n"), Basket),
        ((1, "x"), tuple[int, str]),
        ({1, 2}, set[int]),
        (Color.RED, Color),
        (b"\x00", bytes),
        (None, Item | None),
        (Aliased(userId=7, seen=AWARE), Aliased),
    ],
)
def test_decode_as_rebuilds_the_declared_type(value: Any, hint: Any) -> None:
    back = decode_as(loads(dumps(value)), hint)
    assert back == value
    assert type(back) is type(value)


def test_dataclass_and_model_come_back_as_plain_dicts_without_a_hint() -> None:
    assert roundtrip(POINT) == {"x": 3, "when": AWARE, "tags": ["a", "b"]}
    back = roundtrip([ITEM])[0]
    assert back == {
        "id": U,
        "price": Decimal("0.1"),
        "at": AWARE,
        "point": {"x": 3, "when": AWARE, "tags": ["a", "b"]},
    }
    assert type(back["id"]) is UUID


@pytest.mark.parametrize("hint", [Parameter.empty, Any, None, type(None)])
def test_decode_as_without_a_usable_hint_returns_the_value_itself(hint: Any) -> None:
    value = {"x": [1, 2]}
    assert decode_as(value, hint) is value


@pytest.mark.parametrize(
    ("value", "hint", "named"),
    [
        ("abc", int, "int"),
        ({"x": "nope", "when": AWARE}, Point, "Point"),
        ([{"x": 1}], list[Point], "list["),
        ({"id": "not-a-uuid", "price": "1", "at": AWARE}, Item, "Item"),
    ],
)
def test_decode_as_failure_names_what_and_the_hint(value: Any, hint: Any, named: str) -> None:
    with pytest.raises(SerializationError) as info:
        decode_as(value, hint, what=WHAT)
    assert WHAT in str(info.value)
    assert named in str(info.value)


def test_decode_as_with_an_unhashable_hint_still_works() -> None:
    hint = Annotated[int, ["unhashable metadata"]]
    assert decode_as("5", hint) == 5
    assert decode_as("6", hint) == 6


class NotAType:
    pass


@pytest.mark.parametrize("hint", [NotAType, "Point", list["Point"]])
def test_decode_as_refuses_hints_pydantic_cannot_use(hint: Any) -> None:
    with pytest.raises(SerializationError, match="argument 'x'"):
        decode_as({}, hint, what=WHAT)


# ---- the "__tether__" key in user data -----------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        {"__tether__": "datetime", "v": "2024-01-01T00:00:00+00:00"},
        {"__tether__": "import", "v": "os.system"},
        {"__tether__": {"__tether__": 1}},
        [1, {"__tether__": None, "other": [AWARE]}],
        {"__tether__": "dict", "v": [["a", 1]], "when": AWARE},
        {"when": AWARE, "x": {"__tether__": 1}},  # our tag and a user key in one text
        {"__tether__": 1, "42": 2},  # also sends the value down the key check
    ],
)
def test_user_dict_with_the_tag_key_is_escaped_and_round_trips(value: Any) -> None:
    assert roundtrip(value) == value


def test_dataclass_field_holding_a_tag_key_dict_round_trips() -> None:
    p = Point(1, AWARE, [])
    value = {"p": p, "d": {"__tether__": "uuid", "v": "not decoded"}}
    assert roundtrip(value) == {"p": {"x": 1, "when": AWARE, "tags": []}, "d": value["d"]}


# ---- refusals ------------------------------------------------------------------------------

NAIVE = datetime(2024, 1, 1, 12, 0)


class Opaque:
    pass


@pytest.mark.parametrize(
    ("value", "fragments"),
    [
        (NAIVE, ["naive datetime", "tzinfo", "datetime.now(timezone.utc)"]),
        ([1, [2, {"when": NAIVE}]], ["[1][1]['when']", "naive datetime"]),
        ({"items": [POINT, Point(1, NAIVE)]}, ["['items'][1]['when']", "naive"]),
        ([ITEM.model_copy(update={"at": NAIVE})], ["[0]['at']", "naive"]),
        (math.nan, ["nan", "NaN"]),
        (math.inf, ["inf"]),
        ({"a": [1.0, -math.inf]}, ["['a'][1]", "-inf"]),
        ({1: "a"}, ["dict key 1", "int", "str"]),
        ({"ok": {None: 1}}, ["['ok']", "dict key None"]),
        ({"ok": {True: 1}}, ["dict key True"]),
        ({1.5: 1}, ["dict key 1.5"]),
        ({(1, 2): 1}, ["dict key (1, 2)", "tuple"]),
        (Opaque(), ["Opaque", "not supported", "dataclass or a pydantic model"]),
        ({"f": lambda: 1}, ["['f']", "function", "code"]),
        ([print], ["[0]", "builtin_function_or_method"]),
        (Point, ["type", "not supported"]),  # a dataclass class, not an instance
        ({"s": {Opaque()}}, ["['s']", "Opaque"]),
        (Color, ["EnumType"]),
        ({"k": ["ok", "a\x00b"]}, ["['k'][1]", "NUL"]),
        ({"a\x00": 1}, ["dict key", "NUL"]),
        ([{"s": "\ud800"}], ["[0]['s']", "surrogate"]),
    ],
)
def test_refusals_name_what_path_and_type(value: Any, fragments: list[str]) -> None:
    with pytest.raises(SerializationError) as info:
        dumps(value, what=WHAT)
    message = str(info.value)
    assert WHAT in message
    for fragment in fragments:
        assert fragment in message


def test_a_reference_cycle_is_refused() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    with pytest.raises(SerializationError, match="cycle") as info:
        dumps({"x": loop}, what=WHAT)
    assert WHAT in str(info.value)


# ---- hostile or broken stored data ---------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        ({"__tether__": "import", "v": "os.system"}, "unknown tag"),
        ({"__tether__": "pickle", "v": "gASVAAAAAAAAAAAu"}, "unknown tag"),
        ([1, {"a": {"__tether__": "antigravity", "v": "antigravity"}}], "unknown tag"),
        ({"__tether__": ["datetime"], "v": "x"}, "unknown tag"),
        ({"__tether__": "datetime"}, "malformed"),
        ({"__tether__": "datetime", "v": "x", "extra": 1}, "malformed"),
        ({"__tether__": "datetime", "v": 5}, "'datetime'"),
        ({"__tether__": "datetime", "v": "yesterday"}, "'datetime'"),
        ({"__tether__": "decimal", "v": "abc"}, "'decimal'"),
        ({"__tether__": "decimal", "v": 0.1}, "'decimal'"),
        ({"__tether__": "uuid", "v": "zz"}, "'uuid'"),
        ({"__tether__": "bytes", "v": "!!!"}, "'bytes'"),
        ({"__tether__": "timedelta", "v": ["a"]}, "'timedelta'"),
        ({"__tether__": "timedelta", "v": [10**20]}, "'timedelta'"),
        ({"__tether__": "dict", "v": [[["k"], 1]]}, "'dict'"),
        ({"__tether__": "dict", "v": {"a": 1}}, "'dict'"),
    ],
)
def test_hostile_or_broken_payloads_are_refused(payload: Any, fragment: str) -> None:
    before = set(sys.modules)
    text = json.dumps(payload)
    attempts: list[Callable[[], Any]] = [
        lambda: loads(text),
        lambda: loads(text.encode()),
        lambda: decode(payload),
    ]
    for attempt in attempts:
        with pytest.raises(SerializationError, match=re.escape(fragment)):
            attempt()
    assert set(sys.modules) == before  # nothing was imported on the data's say-so


@pytest.mark.parametrize("text", ["NaN", "[Infinity]", '{"a": -Infinity}', "{", "", "[1,]", b"\xff"])
def test_loads_refuses_invalid_json(text: str | bytes) -> None:
    with pytest.raises(SerializationError):
        loads(text)


def test_loads_accepts_jsonb_style_text_and_bytes() -> None:
    jsonb = '{"v": "2024-03-01T12:30:45.123456+05:30", "__tether__": "datetime"}'
    assert loads(jsonb) == AWARE
    assert loads(b' [1, {"a": "\xc3\xa9"}] ') == [1, {"a": "é"}]


# ---- results -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "result",
    [
        TaskResult(ok=None),
        TaskResult(ok="s3://bucket/key"),
        TaskResult(ok={"at": AWARE, "sum": Decimal("0.1"), "__tether__": 1}),
        TaskResult(err=TaskError("TRANSIENT", "try later")),
        TaskResult(err=TaskError(ErrorCode.WORKER_CRASHED, "pid 12 died", {"pid": 12})),
        TaskResult(err=TaskError("LATE", "missed", {"deadline": AWARE, "ids": [U]})),
    ],
)
def test_result_round_trips(result: TaskResult[Any, TaskError]) -> None:
    text = encode_result(result)
    for back in (decode_result(text), decode_result(text.encode()), decode_result(json.loads(text))):
        assert back.is_ok == result.is_ok
        if result.is_ok:
            assert back.ok == result.ok
        else:
            assert back.err == result.err


def test_result_shapes() -> None:
    assert encode_result(TaskResult(ok=1)) == '{"ok":1}'
    stored = json.loads(encode_result(TaskResult(err=TaskError("X", "m", [AWARE]))))
    assert stored == {"err": {"code": "X", "message": "m", "data": [json.loads(dumps(AWARE))]}}
    back = decode_result({"err": {"code": "WORKER_CRASHED", "message": "", "data": None}})
    assert back.err is not None and back.err.code is ErrorCode.WORKER_CRASHED


def test_unserialisable_results_are_refused_with_what() -> None:
    with pytest.raises(SerializationError, match="result of task 't'"):
        encode_result(TaskResult(ok=Opaque()), what="result of task 't'")
    with pytest.raises(SerializationError, match=r"result error data at \['when'\]"):
        encode_result(TaskResult(err=TaskError("E", "m", {"when": NAIVE})))
    with pytest.raises(SerializationError, match="TaskResult"):
        encode_result(42)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "stored",
    [{}, [], 1, {"foo": 1}, {"ok": 1, "err": None}, {"err": {"code": ""}}, {"err": "boom"}],
)
def test_decode_result_refuses_other_shapes(stored: Any) -> None:
    with pytest.raises(SerializationError, match="result"):
        decode_result(stored)


# ---- concurrency ---------------------------------------------------------------------------


def test_threads_encoding_at_once_get_their_own_tag_counts() -> None:
    values = [
        {"at": AWARE, "id": U},
        {"__tether__": 1, "at": AWARE},
        [{"__tether__": "x"}, {"__tether__": "y"}, U],
    ]
    failures: list[str] = []

    def work(value: Any) -> None:
        for _ in range(2000):
            if loads(dumps(value)) != value:
                failures.append(repr(value))
                return

    threads = [threading.Thread(target=work, args=(v,)) for v in values * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
