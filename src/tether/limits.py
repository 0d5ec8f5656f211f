"""Flow control's declarations (docs/limits.md): ``QueueLimits`` for a queue, and the check of a
concurrency key. What they do is the limited claim's (broker/sql/limited_claims.sql).

A queue's limits live in the database (tether_queue_limits), so that every worker, whatever
its deploy, claims under the same ones: a worker writes the limits its app declares
(``AppConfig(queue_limits={...})``) when it starts, and ``tether queue limit`` sets them by
hand.
"""

from __future__ import annotations

import math
import uuid
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tether.errors import InvalidOptionError
from tether.names import check_storable_text

#: Characters in a concurrency key (it is a btree index entry, as a unique key is).
MAX_CONCURRENCY_KEY_LENGTH = 500
MAX_LIMIT = 1_000_000
MAX_RATE_PERIOD_S = 86_400.0
MAX_WEIGHT = 1_000.0


def _reject_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise PydanticCustomError("bool_not_number", "expected a number, got a bool")
    return value


_Count = Annotated[int, BeforeValidator(_reject_bool), Field(ge=1, le=MAX_LIMIT)]


class QueueLimits(BaseModel):
    """The flow control of one queue. Every field is optional; a queue with limits (even none
    set) has its keys served round-robin.

    - ``max_in_flight``: at most this many of the queue's tasks CLAIMED or RUNNING at once.
    - ``per_key``: at most this many per concurrency key.
    - ``rate_limit`` per ``rate_period_s``: at most that many claims per period, as a token
      bucket of ``burst`` tokens (default ``rate_limit``) refilled evenly in database time.
    - ``key_rate_limit`` per ``key_rate_period_s``: the same rate, for each concurrency key on
      its own (a bucket of ``key_burst`` tokens per key, default ``key_rate_limit``). Tasks
      without a key have no per-key rate.
    - ``key_weights``: a key's share of the round-robin (default 1): weight 2 is served
      twice as often as weight 1.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    max_in_flight: _Count | None = None
    per_key: _Count | None = None
    rate_limit: _Count | None = None
    rate_period_s: Annotated[float, BeforeValidator(_reject_bool)] = 1.0
    burst: _Count | None = None
    key_weights: dict[str, float] = Field(default_factory=dict)
    # Added after the fields above (keyword-only in use): positions of older fields unchanged.
    key_rate_limit: _Count | None = None
    key_rate_period_s: Annotated[float, BeforeValidator(_reject_bool)] = 1.0
    key_burst: _Count | None = None

    @field_validator("rate_period_s", "key_rate_period_s")
    @classmethod
    def _period(cls, value: float, info: ValidationInfo) -> float:
        if not 0.001 <= value <= MAX_RATE_PERIOD_S:
            raise ValueError(
                f"{info.field_name} must be from 0.001 to {MAX_RATE_PERIOD_S:g} seconds, got {value!r}"
            )
        return value

    @field_validator("key_weights")
    @classmethod
    def _weights(cls, value: dict[str, float]) -> dict[str, float]:
        for key, weight in value.items():
            check_concurrency_key(key, "a key of key_weights")
            if isinstance(weight, bool) or not (0 < weight <= MAX_WEIGHT) or math.isnan(weight):
                raise ValueError(
                    f"key_weights[{key!r}] must be more than 0 and at most {MAX_WEIGHT:g}, got {weight!r}"
                )
        return value

    @model_validator(mode="after")
    def _burst_needs_rate(self) -> QueueLimits:
        if self.burst is not None and self.rate_limit is None:
            raise ValueError("burst needs a rate_limit: it is the rate's bucket size")
        if self.key_burst is not None and self.key_rate_limit is None:
            raise ValueError("key_burst needs a key_rate_limit: it is each key's bucket size")
        return self

    @property
    def rate_period_ms(self) -> int | None:
        return None if self.rate_limit is None else max(1, round(self.rate_period_s * 1000))

    @property
    def key_rate_period_ms(self) -> int | None:
        return None if self.key_rate_limit is None else max(1, round(self.key_rate_period_s * 1000))


def check_concurrency_key(key: Any, what: str = "concurrency_key") -> str:
    """A concurrency key as stored: a non-empty str of at most 500 characters (an int or a UUID
    is taken as its text), storable as PostgreSQL text. The error names ``what``."""
    if isinstance(key, int | uuid.UUID) and not isinstance(key, bool):
        key = str(key)
    if not isinstance(key, str):
        raise InvalidOptionError(f"{what} must be a str, an int or a UUID, got {type(key).__name__}")
    if not key:
        raise InvalidOptionError(f"{what} must not be empty")
    if len(key) > MAX_CONCURRENCY_KEY_LENGTH:
        raise InvalidOptionError(
            f"{what} must be at most {MAX_CONCURRENCY_KEY_LENGTH} characters, got {len(key)}"
        )
    return check_storable_text(key, what)
