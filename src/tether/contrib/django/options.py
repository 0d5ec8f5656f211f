"""A TetherBackend's settings: QUEUES and OPTIONS checked, each error naming the key at fault.

    TASKS = {"default": {
        "BACKEND": "tether.contrib.django.TetherBackend",
        "QUEUES": ["default", "emails"],
        "OPTIONS": {
            "DATABASE": "default",                   # a DATABASES alias (PostgreSQL)
            "RETRY_POLICY": {...} | RetryPolicy,     # every task's, unless TASK_OPTIONS says
            "TIME_LIMIT": 600,                       # seconds an attempt may run (every task's)
            "TASK_OPTIONS": {"shop.tasks.charge": {"RETRY_POLICY": ..., "TIME_LIMIT": ...}},
            "RECOVERY": {...} | RecoveryConfig,      # tether's RecoveryConfig fields
            "WORKER": {...} | WorkerConfig,          # tether's WorkerConfig fields
            "BROKER": {...},                         # PostgresConfig fields but database_url
            "AUTO_MIGRATE": True,
        },
    }}

Everything is checked when Django first builds the backend (at the first ``@task``), so a
typo fails the import of the tasks module, not a task at three in the morning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from django.core.exceptions import ImproperlyConfigured
from django.tasks import DEFAULT_TASK_QUEUE_NAME
from pydantic import BaseModel, ValidationError

from tether.config import AppConfig, PostgresConfig, RecoveryConfig, RetryPolicy, WorkerConfig
from tether.errors import TaskDefinitionError
from tether.options import MAX_TIME_LIMIT, check_time_limit

OPTION_KEYS = frozenset(
    {
        "DATABASE",
        "RETRY_POLICY",
        "TIME_LIMIT",
        "TASK_OPTIONS",
        "RECOVERY",
        "WORKER",
        "BROKER",
        "AUTO_MIGRATE",
    }
)
TASK_OPTION_KEYS = frozenset({"RETRY_POLICY", "TIME_LIMIT"})

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class TaskSettings:
    """What tether adds to one Django task: how it is retried and how long an attempt may run."""

    retry_policy: RetryPolicy | None = None
    time_limit: float | None = None  # seconds


@dataclass(frozen=True, slots=True)
class BackendSettings:
    database: str  # the DATABASES alias tether's tables live in
    queues: list[str]  # the tether queues: Django's QUEUES, in their order
    default_queue: str
    recovery: RecoveryConfig
    worker: WorkerConfig
    broker: dict[str, Any]  # PostgresConfig fields, without the URL (it comes from DATABASE)
    auto_migrate: bool
    defaults: TaskSettings  # every task's, unless per_task names it
    per_task: dict[str, TaskSettings] = field(default_factory=dict)  # by Task.module_path

    def for_task(self, module_path: str) -> TaskSettings:
        return self.per_task.get(module_path, self.defaults)

    def app_config(self, database_url: str) -> AppConfig:
        """tether's AppConfig for this backend, on the database at ``database_url``."""
        return AppConfig(
            broker=PostgresConfig(database_url=database_url, **self.broker),
            recovery=self.recovery,
            worker=self.worker,
            queues=self.queues,
            default_queue=self.default_queue,
            auto_migrate=self.auto_migrate,
        )


def parse_settings(alias: str, params: Mapping[str, Any]) -> BackendSettings:
    """The backend's QUEUES and OPTIONS, checked; ImproperlyConfigured names the key at fault."""
    where = f"TASKS[{alias!r}]"
    queues = _queues(where, params.get("QUEUES"))
    options = params.get("OPTIONS") or {}
    if not isinstance(options, Mapping):
        raise ImproperlyConfigured(f"{where}['OPTIONS'] must be a dict, got {type(options).__name__}")
    where = f"{where}['OPTIONS']"
    unknown = sorted(str(k) for k in options if k not in OPTION_KEYS)
    if unknown:
        raise ImproperlyConfigured(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; "
            f"known keys: {', '.join(sorted(OPTION_KEYS))}"
        )
    database = options.get("DATABASE", "default")
    if not isinstance(database, str) or not database:
        raise ImproperlyConfigured(f"{where}['DATABASE'] must be a DATABASES alias (a str), got {database!r}")
    auto_migrate = options.get("AUTO_MIGRATE", True)
    if not isinstance(auto_migrate, bool):
        raise ImproperlyConfigured(f"{where}['AUTO_MIGRATE'] must be True or False, got {auto_migrate!r}")
    settings = BackendSettings(
        database=database,
        queues=queues,
        default_queue=DEFAULT_TASK_QUEUE_NAME if DEFAULT_TASK_QUEUE_NAME in queues else queues[0],
        recovery=_model(f"{where}['RECOVERY']", RecoveryConfig, options.get("RECOVERY")),
        worker=_model(f"{where}['WORKER']", WorkerConfig, options.get("WORKER")),
        broker=_broker(f"{where}['BROKER']", options.get("BROKER")),
        auto_migrate=auto_migrate,
        defaults=_task_settings(where, options),
        per_task=_per_task(f"{where}['TASK_OPTIONS']", options.get("TASK_OPTIONS")),
    )
    try:  # what only the whole config can check: worker queues declared, pool sizes, ...
        settings.app_config("postgresql://check@localhost/check")
    except ValidationError as exc:
        raise ImproperlyConfigured(f"{where}: {exc}") from None
    return settings


def _queues(where: str, value: Any) -> list[str]:
    """Django's QUEUES as tether queues; missing or empty means Django's default queue only."""
    if value is None:
        return [DEFAULT_TASK_QUEUE_NAME]
    if isinstance(value, str) or not isinstance(value, list | tuple | set | frozenset):
        raise ImproperlyConfigured(f"{where}['QUEUES'] must be a list of queue names, got {value!r}")
    names = list(value)
    if not names:
        # Django reads [] as "any queue name"; a worker must know which queues to claim from,
        # so tether serves Django's default queue only and refuses others when they are used.
        return [DEFAULT_TASK_QUEUE_NAME]
    try:
        AppConfig.model_validate({"queues": names, "default_queue": names[0]})
    except ValidationError as exc:
        raise ImproperlyConfigured(f"{where}['QUEUES']: {_errors(exc)}") from None
    return names


def _model(where: str, cls: type[M], value: Any) -> M:
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ImproperlyConfigured(
            f"{where} must be a dict of {cls.__name__} fields or a {cls.__name__}, got {type(value).__name__}"
        )
    try:
        return cls(**{str(k).lower(): v for k, v in value.items()})
    except ValidationError as exc:
        raise ImproperlyConfigured(f"{where}: {_errors(exc)}") from None


def _broker(where: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ImproperlyConfigured(f"{where} must be a dict of PostgresConfig fields, got {value!r}")
    broker = {str(k).lower(): v for k, v in value.items()}
    if "database_url" in broker:
        raise ImproperlyConfigured(
            f"{where}: give no database_url; the database is Django's, named by OPTIONS['DATABASE']"
        )
    try:
        PostgresConfig(database_url="postgresql://check@localhost/check", **broker)
    except ValidationError as exc:
        raise ImproperlyConfigured(f"{where}: {_errors(exc)}") from None
    return broker


def _task_settings(where: str, options: Mapping[str, Any]) -> TaskSettings:
    return TaskSettings(
        retry_policy=_retry_policy(f"{where}['RETRY_POLICY']", options.get("RETRY_POLICY")),
        time_limit=_time_limit(f"{where}['TIME_LIMIT']", options.get("TIME_LIMIT")),
    )


def _per_task(where: str, value: Any) -> dict[str, TaskSettings]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ImproperlyConfigured(
            f"{where} must be a dict of task path (Task.module_path) -> options, got {value!r}"
        )
    per_task: dict[str, TaskSettings] = {}
    for path, task_options in value.items():
        here = f"{where}[{path!r}]"
        if not isinstance(path, str) or "." not in path:
            raise ImproperlyConfigured(f"{here}: keys are task paths such as 'shop.tasks.charge'")
        if not isinstance(task_options, Mapping):
            raise ImproperlyConfigured(f"{here} must be a dict with RETRY_POLICY and/or TIME_LIMIT")
        unknown = sorted(str(k) for k in task_options if k not in TASK_OPTION_KEYS)
        if unknown:
            raise ImproperlyConfigured(
                f"{here}: unknown key(s) {', '.join(map(repr, unknown))}; "
                "known keys: RETRY_POLICY, TIME_LIMIT"
            )
        per_task[path] = _task_settings(here, task_options)
    return per_task


def _retry_policy(where: str, value: Any) -> RetryPolicy | None:
    if value is None or isinstance(value, RetryPolicy):
        return value
    if not isinstance(value, Mapping):
        raise ImproperlyConfigured(
            f"{where} must be a RetryPolicy or a dict of its fields (kind, base_seconds, "
            f"max_retries, auto_retry_for, ...), got {type(value).__name__}"
        )
    try:
        return RetryPolicy.model_validate({str(k).lower(): v for k, v in value.items()})
    except ValidationError as exc:
        raise ImproperlyConfigured(f"{where}: {_errors(exc)}") from None


def _time_limit(where: str, value: Any) -> float | None:
    try:
        return check_time_limit(where, value)
    except TaskDefinitionError:
        raise ImproperlyConfigured(
            f"{where} must be a number of seconds or a timedelta, more than 0 and at most "
            f"{MAX_TIME_LIMIT.days} days, got {value!r}"
        ) from None


def _errors(exc: ValidationError) -> str:
    """pydantic's errors as one line each: the field, then why."""
    return "; ".join(
        f"{'.'.join(str(p) for p in error['loc']) or 'value'}: {error['msg']}" for error in exc.errors()
    )
