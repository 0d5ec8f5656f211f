"""A batch of tasks under unique keys (``send_many(unique_keys=[...])``, or a view with
``unique_key``): one proposed task per distinct key, each written unless its key is held,
all in one transaction (docs/tasks.md#unique-sends)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from uuid import UUID

from tether.broker import unique as unique_sends
from tether.broker.tasks import SendSpec
from tether.broker.types import AsyncConn, Conn
from tether.errors import InvalidOptionError
from tether.handle import TaskHandle
from tether.ids import new_task_ids
from tether.options import check_unique_for, check_unique_key
from tether.sending.basis import Items, SendBasis
from tether.sending.many import SEND_MANY_CHUNK


@dataclass(frozen=True, slots=True)
class ManyUniqueSend:
    """A unique batch checked and encoded: each item's key, and the one task proposed per key.

    Items that repeat a key are folded into the first item with that key (its arguments are
    the ones sent), since one statement cannot take one key twice.
    """

    basis: SendBasis
    keys: list[str]  # item i's key
    proposed: dict[str, UUID]  # the id proposed for each distinct key
    first: dict[str, int]  # the first item with each key
    spec: SendSpec
    window: timedelta | None
    distinct: list[str]  # the distinct keys, sorted; the three lists below in the same order
    ids: list[UUID]
    args: list[str]
    kwargs: list[str]

    all_or_none = True
    repeatable = False  # its statement answers with each key's holder: run again, it still does

    @classmethod
    def prepare(
        cls,
        basis: SendBasis,
        items: Items,
        common: dict[str, Any],
        unique_keys: Sequence[str] | None,
        unique_for: timedelta | float | None,
    ) -> ManyUniqueSend:
        held = basis.unique
        window = held.window if held is not None else None
        if unique_for is not None:
            window = check_unique_for(unique_for)
        spec, args_list, kwargs_list = basis.encode_items(items, common)
        if spec.concurrency_keys is not None:
            raise InvalidOptionError(
                f"send_many of task {basis.task.name!r} with unique keys takes one concurrency key for "
                "all items (concurrency_key=...), not one per item from an argument"
            )
        if unique_keys is None:
            assert held is not None  # tether.task picks this plan only with some key
            keys = [held.key] * len(args_list)
        else:
            if held is not None:
                raise InvalidOptionError(
                    "send_many got unique_keys, and this task view already has a "
                    f"unique_key ({held.key!r}) from with_options; give one or the other"
                )
            if isinstance(unique_keys, str | bytes) or not isinstance(unique_keys, Sequence):
                raise InvalidOptionError(
                    f"unique_keys must be a list of str, one per item, got {type(unique_keys).__name__}"
                )
            if len(unique_keys) != len(args_list):
                raise InvalidOptionError(
                    f"unique_keys must have one key per item: {len(args_list)} item(s), "
                    f"{len(unique_keys)} key(s)"
                )
            keys = [check_unique_key(k, f"unique_keys[{i}]") for i, k in enumerate(unique_keys)]
        first: dict[str, int] = {}
        for index, key in enumerate(keys):
            first.setdefault(key, index)
        # Code-point order, the order the statement locks keys in ("C" collation), so the
        # chunks of two batches sharing keys lock them in one order too.
        distinct = sorted(first)
        proposed = dict(zip(distinct, new_task_ids(len(distinct)), strict=True))
        return cls(
            basis,
            keys,
            proposed,
            first,
            spec,
            window,
            distinct,
            [proposed[k] for k in distinct],
            [args_list[first[k]] for k in distinct],
            [kwargs_list[first[k]] for k in distinct],
        )

    @property
    def empty(self) -> bool:
        return not self.keys

    def write(self, conn: Conn) -> dict[str, UUID]:
        """Returns the task holding each key."""
        return unique_sends.insert_unique_tasks(conn, *self._rows(), chunk=SEND_MANY_CHUNK)

    async def write_async(self, conn: AsyncConn) -> dict[str, UUID]:
        return await unique_sends.insert_unique_tasks_async(conn, *self._rows(), chunk=SEND_MANY_CHUNK)

    def _rows(self) -> tuple[SendSpec, timedelta | None, list[str], list[UUID], list[str], list[str]]:
        """What the statement takes, in its order: one row per distinct key."""
        return self.spec, self.window, self.distinct, self.ids, self.args, self.kwargs

    def handles(self, holders: Mapping[str, UUID]) -> list[TaskHandle[Any]]:
        """One handle per item: the task holding its key; deduplicated unless this item created it."""
        return [
            self.basis.handle(
                holders[key],
                deduplicated=not (self.first[key] == index and holders[key] == self.proposed[key]),
            )
            for index, key in enumerate(self.keys)
        ]
