"""Configuration: AppConfig, PostgresConfig, RecoveryConfig, WorkerConfig and RetryPolicy.

Why pydantic: a bad config must be refused at construction with a message that names the
field and says why (``ValidationError``, a ``ValueError``, lists each failing field and its
reason). Every setting is also readable from a ``TETHER_*`` environment variable, explicit
arguments taking precedence (tether.env_settings: the variable's text goes through the
field's own validation).
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import re
from collections.abc import Iterable
from typing import Annotated, Any, ClassVar, Literal

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

from tether.env_settings import EnvSettings
from tether.limits import QueueLimits
from tether.names import QUEUE_NAME_RULE, is_queue_name
from tether.result import ErrorCode

__all__ = [
    "AppConfig",
    "LoggingConfig",
    "PostgresConfig",
    "RecoveryConfig",
    "RetryPolicy",
    "WorkerConfig",
    "mask_url",
]

# The whole string must match: use fullmatch ("^...$" with match lets a final newline in).
ERROR_CODE_RE = re.compile(r"[A-Za-z0-9_.:-]{1,100}")


def _reject_bool(value: Any) -> Any:
    # bool is an int subclass, so pydantic's lax mode would take True as 1: almost always a
    # slip (a flag passed to the wrong field), never a meaningful number.
    if isinstance(value, bool):
        raise PydanticCustomError("bool_not_number", "expected a number, got a bool")
    return value


# Lax otherwise, so env strings like "60000" parse; 1.5 is still refused for an int.
Int = Annotated[int, BeforeValidator(_reject_bool)]
Float = Annotated[float, BeforeValidator(_reject_bool)]


def _none_words(value: Any) -> Any:
    # An env var can only hold a string, so "none"/"null"/"" is how it says "disabled".
    if isinstance(value, str) and value.strip().lower() in {"", "none", "null"}:
        return None
    return value


OptInt = Annotated[Int | None, BeforeValidator(_none_words)]


def _split_names(value: Any) -> Any:
    # Env lists arrive as "a,b" (or JSON "[...]"); Python callers pass a list.
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [part.strip() for part in text.split(",") if part.strip()]
    return value


def _check_queue_names(field: str, names: list[str]) -> list[str]:
    if not names:
        raise ValueError(f"{field} must name at least one queue")
    bad = [n for n in names if not is_queue_name(n)]
    if bad:
        raise ValueError(f"{field}: invalid queue name(s) {bad}; each must be {QUEUE_NAME_RULE}")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"{field}: queue name(s) {dupes} listed more than once")
    return names


QueueList = Annotated[list[str], BeforeValidator(_split_names)]
# Validators run last-declared first: "" / "none" mean None before any splitting.
OptQueueList = Annotated[list[str] | None, BeforeValidator(_split_names), BeforeValidator(_none_words)]


def mask_url(url: str) -> str:
    """``url`` with any password (in the user-info part or a ``password=`` parameter) as ``***``.

    Errors and logs name the database URL so a user can see which server was meant;
    they must never print its secret.
    """
    scheme, sep, rest = url.partition("://")
    if sep:
        # The user-info ends at the last '@' before the query: over-masking a malformed
        # URL (an unescaped '@' in the password) is safe, leaking part of it is not.
        query_at = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
        at = rest.rfind("@", 0, query_at)
        if at >= 0 and ":" in rest[:at]:
            user = rest[:at].partition(":")[0]
            rest = f"{user}:***{rest[at:]}"
        url = f"{scheme}{sep}{rest}"
    # Query parameters (?password=...) and libpq key=value strings (password=...).
    return re.sub(r"(?i)(^|[?&\s])(password=)[^&\s#]*", r"\1\2***", url)


class RecoveryConfig(EnvSettings):
    """How workers prove they are alive and how the reaper recovers what dead ones left behind."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, validate_default=True)
    env_prefix: ClassVar[str] = "TETHER_"

    auto_requeue_stale_claimed: bool = True
    claimed_stale_threshold_ms: Int = Field(default=120_000, ge=1_000, le=3_600_000)
    auto_fail_stale_running: bool = True
    running_stale_threshold_ms: Int = Field(default=300_000, ge=1_000, le=7_200_000)
    check_interval_ms: Int = Field(default=30_000, ge=1_000, le=600_000)
    runner_heartbeat_interval_ms: Int = Field(default=30_000, ge=1_000, le=120_000)
    claimer_heartbeat_interval_ms: Int = Field(default=30_000, ge=1_000, le=120_000)
    # Opt-in (None: off). A worker with it records its listener session in its registry row;
    # once that session is gone from the server (the worker's process died: its kernel closed
    # the connection) and its last heartbeat is older than this, any reaper recovers its tasks
    # without waiting for the stale thresholds. The worker also isolates itself after this
    # much silence, not the running threshold. docs/heartbeats-and-recovery.md says the risk.
    session_closed_threshold_ms: OptInt = Field(default=None, ge=1_250, le=7_200_000)
    # None disables that category of pruning.
    heartbeat_retention_hours: OptInt = Field(default=24, ge=1)
    worker_state_retention_hours: OptInt = Field(default=168, ge=1)
    terminal_record_retention_hours: OptInt = Field(default=720, ge=1)

    @model_validator(mode="after")
    def _thresholds_cover_two_heartbeats(self) -> RecoveryConfig:
        # One late heartbeat (a GC pause, a slow commit) must not make a live task look dead,
        # so a task is only stale after missing at least two beats in a row.
        pairs = (
            ("claimed_stale_threshold_ms", "claimer_heartbeat_interval_ms"),
            ("running_stale_threshold_ms", "runner_heartbeat_interval_ms"),
        )
        for threshold, interval in pairs:
            t, i = getattr(self, threshold), getattr(self, interval)
            if t < 2 * i:
                raise ValueError(
                    f"{threshold} ({t}) must be at least 2 x {interval} ({i}) = "
                    f"{2 * i}, so one late heartbeat does not mark a live task stale"
                )
        closed = self.session_closed_threshold_ms
        if closed is not None:
            # The heartbeat writer beats at the smaller interval; a live worker's next beat must
            # be seen within the threshold even when it comes a quarter of an interval late.
            every = min(self.claimer_heartbeat_interval_ms, self.runner_heartbeat_interval_ms)
            if closed * 4 < 5 * every:
                raise ValueError(
                    f"session_closed_threshold_ms ({closed}) must be at least 1.25 x the heartbeat "
                    f"interval ({every}) = {5 * every // 4}, so one late heartbeat does not mark a "
                    "live worker dead"
                )
            if closed > self.running_stale_threshold_ms:
                raise ValueError(
                    f"session_closed_threshold_ms ({closed}) must not exceed running_stale_threshold_ms "
                    f"({self.running_stale_threshold_ms}): the stale rule would always decide first"
                )
        return self


class PostgresConfig(EnvSettings):
    """Where the database is. No URL means the embedded server shared by the machine."""

    # hide_input_in_errors: a rejected URL would otherwise be echoed, password included.
    model_config = ConfigDict(
        frozen=True, extra="forbid", allow_inf_nan=False, hide_input_in_errors=True, validate_default=True
    )
    env_prefix: ClassVar[str] = "TETHER_"

    database_url: str | None = None
    # What sits between tether and PostgreSQL (docs/pgbouncer.md). "transaction": a pooler in
    # transaction mode (PgBouncer's pool_mode=transaction): no statement is prepared, no
    # startup option is sent, and LISTEN goes only to listen_url (without one, workers and
    # handles poll). "session": a pooler in session mode: only the startup options change.
    pooler: Literal["none", "session", "transaction"] = "none"
    # A direct (not pooled) URL for LISTEN connections only; None: the database_url.
    listen_url: str | None = None
    pool_min_size: Int = Field(default=1, ge=0, le=100)
    pool_max_size: Int = Field(default=10, ge=1, le=200)
    connect_timeout_s: Float = Field(default=5.0, ge=0.1, le=300)
    application_name: str = "tether"
    # False: a send's commit does not wait for the WAL flush (synchronous_commit=off for
    # that transaction only). A database server crash can then lose the last moments of
    # acknowledged sends; nothing else changes. See docs/configuration.md#durable-sends.
    durable_sends: bool = True

    @field_validator("database_url", "listen_url", mode="before")
    @classmethod
    def _check_url(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str):
            value = value.strip()
            if not value:
                return None  # TETHER_DATABASE_URL="" means "no URL": use the embedded server
            if not value.startswith(("postgresql://", "postgres://")):
                raise ValueError(
                    f"{info.field_name} must start with postgresql:// or postgres:// "
                    f"(got {mask_url(value)!r})"
                )
        return value

    @field_validator("pooler", mode="before")
    @classmethod
    def _pooler_word(cls, value: Any) -> Any:
        # TETHER_POOLER=Transaction or " transaction " from a shell: the same mode.
        return value.strip().lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _pooler_needs_a_server(self) -> PostgresConfig:
        # The embedded server is reached directly, never through a pooler: either setting
        # without a database_url is a mistake (a URL set under another variable name).
        if self.database_url is None and self.pooler != "none":
            raise ValueError(
                f"pooler is {self.pooler!r} but database_url is not set: the embedded server has no "
                "pooler in front of it. Set database_url (TETHER_DATABASE_URL) to the pooler's URL"
            )
        if self.database_url is None and self.listen_url is not None:
            raise ValueError(
                f"listen_url is set ({mask_url(self.listen_url)!r}) but database_url is not: listen_url "
                "is the direct URL of the server behind the pooler that database_url "
                "(TETHER_DATABASE_URL) names"
            )
        if self.pooler == "transaction" and self.listen_url == self.database_url:
            raise ValueError(
                "listen_url is the same URL as database_url, the transaction pooler's: LISTEN does not "
                "work through a transaction pooler. Give listen_url a direct URL to PostgreSQL, or "
                "leave it unset to poll (docs/pgbouncer.md)"
            )
        return self

    @model_validator(mode="after")
    def _pool_sizes(self) -> PostgresConfig:
        if self.pool_max_size < self.pool_min_size:
            raise ValueError(
                f"pool_max_size ({self.pool_max_size}) must be >= pool_min_size ({self.pool_min_size})"
            )
        return self

    @property
    def masked_url(self) -> str | None:
        """The URL safe to print (password as ``***``), or None for the embedded server."""
        return None if self.database_url is None else mask_url(self.database_url)

    @property
    def prepares_statements(self) -> bool:
        """Whether tether's connections may prepare statements (psycopg does so by itself for a
        statement run often): not through a transaction pooler, whose next transaction may run
        on another server session, one that lacks the statement or has another of that name."""
        return self.pooler != "transaction"

    def __repr_args__(self) -> Iterable[tuple[str | None, Any]]:
        # repr() ends up in logs and tracebacks: show the URLs masked.
        for name, value in super().__repr_args__():
            if name in ("database_url", "listen_url") and isinstance(value, str):
                value = mask_url(value)
            yield name, value


class WorkerConfig(EnvSettings):
    """One worker: how many child processes, which queues, how eagerly it claims."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, validate_default=True)
    env_prefix: ClassVar[str] = "TETHER_WORKER_"

    # Sync child processes (one task at a time each). None = the machine's CPU count when
    # the app has sync tasks (clamped to 256), else 0; see tether.worker.lanes.
    processes: OptInt = Field(default=None, ge=0, le=256)
    # Async child processes (many `async def` tasks at once each). None = 1 when the app
    # has async tasks, else 0.
    async_processes: OptInt = Field(default=None, ge=0, le=256)
    # How many async tasks one async child runs at once.
    async_concurrency: Int = Field(default=100, ge=1, le=10_000)
    # A task whose cancel was requested, or an async task cancelled at its time limit, has
    # its process killed if it has not ended this long after (a task's cancel_grace overrides).
    cancel_grace_s: Float = Field(default=5.0, ge=0, le=3_600)
    queues: OptQueueList = None  # None = every queue the app declares
    # Claimed-but-not-started tasks each kind of child may hold beyond its running ones;
    # None = PREFETCH_PER_PROCESS (4) per sync process, async_concurrency per async process.
    prefetch: OptInt = Field(default=None, ge=0, le=100_000)
    # The fallback poll when no NOTIFY arrives (a notification can be lost on reconnect).
    poll_interval_ms: Int = Field(default=1_000, ge=10, le=60_000)
    grace_period_s: Float = Field(default=30.0, ge=0, le=86_400)
    claim_batch_size: Int = Field(default=100, ge=1, le=10_000)
    # Serve Prometheus metrics on this port (docs/monitoring.md); None: no endpoint, no cost.
    metrics_port: OptInt = Field(default=None, ge=1, le=65_535)
    # The address the metrics endpoint listens on (every interface: Prometheus scrapes from
    # elsewhere; the metrics hold names and counts, never a task's arguments or errors).
    metrics_host: str = "0.0.0.0"
    # How child processes are made (tether.worker.start_method, docs/workers.md): forked from
    # a fork server that imported tether and the app once, or spawned (each imports anew).
    start_method: Literal["forkserver", "spawn"] = "forkserver"

    @field_validator("queues")
    @classmethod
    def _check_queues(cls, value: list[str] | None) -> list[str] | None:
        return None if value is None else _check_queue_names("queues", value)

    @model_validator(mode="after")
    def _some_process(self) -> WorkerConfig:
        if self.processes == 0 and self.async_processes == 0:
            raise ValueError("processes and async_processes are both 0: a worker needs at least one child")
        return self


PREFETCH_PER_PROCESS = 4

#: How log lines are written: ``human`` (the default) or ``json``, one object a line.
LogFormat = Literal["human", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("human", "json")


class LoggingConfig(EnvSettings):
    """How a worker's processes and the dashboard write log lines (docs/configuration.md#log-format)."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)
    env_prefix: ClassVar[str] = "TETHER_LOG_"

    format: LogFormat = "human"  # TETHER_LOG_FORMAT; `--log-format` overrides it

    @field_validator("format", mode="before")
    @classmethod
    def _known_format(cls, value: Any) -> Any:
        text = value.strip().lower() if isinstance(value, str) else value
        if text not in LOG_FORMATS:
            raise ValueError(
                f"log format (TETHER_LOG_FORMAT) must be one of {', '.join(LOG_FORMATS)}, got {value!r}"
            )
        return text


def _normalise_codes(value: Any) -> Any:
    if isinstance(value, str):
        value = [value]  # one code, not the set of its characters
    if not isinstance(value, Iterable):
        return value  # let pydantic report the type error
    codes: list[Any] = []
    for code in value:
        if not isinstance(code, str) or not ERROR_CODE_RE.fullmatch(code):
            raise ValueError(
                f"auto_retry_for: {code!r} is not an error code; use an ErrorCode "
                "or a string of 1-100 characters from A-Z a-z 0-9 _ . : -"
            )
        # Plain str values: the policy is stored as JSON and compared with codes from rows.
        codes.append(code.value if isinstance(code, ErrorCode) else code)
    return frozenset(codes)


class RetryPolicy(BaseModel):
    """When a failed task is tried again, and after how long.

    Stored (``to_json``) on each task row, so a reaper in another process can decide
    whether a crashed task is retried without importing the task's code.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    kind: Literal["fixed", "exponential"]
    max_retries: Int = Field(ge=0, le=1_000)
    base_seconds: Float = Field(gt=0, le=86_400)  # the interval, for "fixed"
    max_seconds: Float = Field(default=3_600, gt=0, le=7 * 86_400)  # caps exponential growth
    # The delay is multiplied by a random factor in [1 - jitter, 1 + jitter].
    jitter: Float = Field(default=0.1, ge=0, le=1)
    auto_retry_for: Annotated[frozenset[str], BeforeValidator(_normalise_codes)]

    @field_validator("auto_retry_for")
    @classmethod
    def _not_empty(cls, value: frozenset[str]) -> frozenset[str]:
        if not value:
            raise ValueError(
                "auto_retry_for must name at least one error code: a retry policy "
                "that retries nothing is a mistake (leave retry_policy unset instead)"
            )
        return value

    @model_validator(mode="after")
    def _cap_above_base(self) -> RetryPolicy:
        # Only exponential growth is capped: a fixed 2 h interval must not fail for a
        # default cap of 1 h that the user never set.
        if self.kind == "exponential" and self.max_seconds < self.base_seconds:
            raise ValueError(
                f"max_seconds ({self.max_seconds}) must be >= base_seconds ({self.base_seconds})"
            )
        return self

    @classmethod
    def fixed(
        cls,
        seconds: float,
        *,
        max_retries: int,
        auto_retry_for: Iterable[str | ErrorCode] | str,
        jitter: float = 0.1,
    ) -> RetryPolicy:
        """Wait ``seconds`` (± jitter) before each retry."""
        return cls(
            kind="fixed",
            base_seconds=seconds,
            max_retries=max_retries,
            auto_retry_for=auto_retry_for,  # type: ignore[arg-type]  # the validator normalises it
            jitter=jitter,
        )

    @classmethod
    def exponential(
        cls,
        base_seconds: float,
        *,
        max_retries: int,
        auto_retry_for: Iterable[str | ErrorCode] | str,
        max_seconds: float = 3_600,
        jitter: float = 0.1,
    ) -> RetryPolicy:
        """Wait ``base_seconds * 2**(n-1)`` (capped at ``max_seconds``, ± jitter) before retry n."""
        return cls(
            kind="exponential",
            base_seconds=base_seconds,
            max_retries=max_retries,
            auto_retry_for=auto_retry_for,  # type: ignore[arg-type]  # the validator normalises it
            max_seconds=max_seconds,
            jitter=jitter,
        )

    def delay_seconds(self, retry_number: int, rand: random.Random | None = None) -> float:
        """Seconds to wait before retry ``retry_number`` (the first retry is 1)."""
        if isinstance(retry_number, bool) or not isinstance(retry_number, int) or retry_number < 1:
            raise ValueError(f"retry_number must be an int >= 1, got {retry_number!r}")
        if self.kind == "fixed":
            delay = self.base_seconds
        else:
            try:
                delay = min(math.ldexp(self.base_seconds, retry_number - 1), self.max_seconds)
            except OverflowError:  # 2**n beyond float range: long past the cap
                delay = self.max_seconds
        if self.jitter:
            # Jitter spreads retries of tasks that failed together (one outage) over time.
            delay *= 1 + (rand or random).uniform(-self.jitter, self.jitter)
        return min(max(delay, 0.0), max(self.max_seconds, self.base_seconds) * (1 + self.jitter))

    def retries_on(self, code: str) -> bool:
        return code in self.auto_retry_for

    def should_retry(self, code: str, retry_count: int) -> bool:
        """Whether a failure with ``code``, after ``retry_count`` retries so far, is retried."""
        if retry_count < 0:
            raise ValueError(f"retry_count must be >= 0, got {retry_count}")
        return self.retries_on(code) and retry_count < self.max_retries

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "max_retries": self.max_retries,
            "base_seconds": self.base_seconds,
            "max_seconds": self.max_seconds,
            "jitter": self.jitter,
            "auto_retry_for": sorted(self.auto_retry_for),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RetryPolicy:
        return cls.model_validate(data)


def _settings_from_dict(cls: type[EnvSettings]) -> Any:
    # A nested dict (from a file, or TETHER_BROKER='{...}') goes through the settings class's
    # constructor, so the fields it leaves out still come from the environment.
    def build(value: Any) -> Any:
        return cls(**value) if isinstance(value, dict) else value

    return BeforeValidator(build)


class AppConfig(EnvSettings):
    """Everything a tether app needs. ``AppConfig()`` alone uses the embedded database."""

    # hide_input_in_errors: the echoed input could hold a broker dict with a password.
    model_config = ConfigDict(
        frozen=True, extra="forbid", allow_inf_nan=False, hide_input_in_errors=True, validate_default=True
    )
    env_prefix: ClassVar[str] = "TETHER_"

    broker: Annotated[PostgresConfig, _settings_from_dict(PostgresConfig)] = Field(
        default_factory=PostgresConfig
    )
    recovery: Annotated[RecoveryConfig, _settings_from_dict(RecoveryConfig)] = Field(
        default_factory=RecoveryConfig
    )
    worker: Annotated[WorkerConfig, _settings_from_dict(WorkerConfig)] = Field(default_factory=WorkerConfig)
    logging: Annotated[LoggingConfig, _settings_from_dict(LoggingConfig)] = Field(
        default_factory=LoggingConfig
    )
    queues: QueueList = Field(default_factory=lambda: ["default"])
    default_queue: str = "default"
    # How often TaskHandle.get re-reads the row when no notification arrives.
    result_poll_interval_ms: Int = Field(default=500, ge=10, le=60_000)
    auto_migrate: bool = True  # apply pending schema migrations on first connection
    # OpenTelemetry spans for sends and runs (TETHER_TRACING; docs/monitoring.md#tracing).
    # Needs the tether[otel] extra; the application configures the SDK and its exporter.
    tracing: bool = False

    @field_validator("tracing")
    @classmethod
    def _otel_installed(cls, value: bool) -> bool:
        # find_spec imports nothing: with tracing off, OpenTelemetry is never imported.
        if value and importlib.util.find_spec("opentelemetry") is None:
            raise ValueError(
                "tracing (TETHER_TRACING) needs the OpenTelemetry API: pip install 'tether[otel]'"
            )
        return value

    # Flow control per queue (docs/limits.md): each worker writes these to the database at
    # start; the limited claim reads them there, so every worker claims under the same ones.
    queue_limits: dict[str, QueueLimits] = Field(default_factory=dict)

    @field_validator("queues")
    @classmethod
    def _check_queues(cls, value: list[str]) -> list[str]:
        return _check_queue_names("queues", value)

    @model_validator(mode="after")
    def _queues_are_declared(self) -> AppConfig:
        if self.default_queue not in self.queues:
            raise ValueError(
                f"default_queue {self.default_queue!r} must be one of queues "
                f"{self.queues}: set default_queue (TETHER_DEFAULT_QUEUE) to one"
            )
        undeclared = [q for q in self.queue_limits if q not in self.queues]
        if undeclared:
            raise ValueError(
                f"queue_limits names queue(s) {undeclared} that are not declared; "
                f"declared queues: {self.queues}"
            )
        unknown = [q for q in self.worker.queues or () if q not in self.queues]
        if unknown:
            raise ValueError(
                f"worker.queues names queue(s) {unknown} that are not declared; "
                f"declared queues: {self.queues}"
            )
        return self
