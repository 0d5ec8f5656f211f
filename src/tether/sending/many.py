"""A batch of tasks (``send_many`` and ``send_many_async``, without keys): one transaction,
all or none, one statement per SEND_MANY_CHUNK tasks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

from tether.broker import tasks
from tether.broker.tasks import SendSpec
from tether.broker.types import AsyncConn, Conn
from tether.errors import InvalidOptionError
from tether.handle import TaskHandle
from tether.ids import new_task_ids
from tether.sending.basis import Items, SendBasis

#: Rows per INSERT; bigger batches run several statements in one transaction.
SEND_MANY_CHUNK = 20_000


@dataclass(frozen=True, slots=True)
class ManySend:
    """A batch checked and encoded: task ``ids[i]`` gets ``args[i]`` and ``kwargs[i]``."""

    basis: SendBasis
    spec: SendSpec
    ids: list[UUID]
    args: list[str]
    kwargs: list[str]

    all_or_none = True
    repeatable = True  # the ids are the client's (see one.OneSend)

    @classmethod
    def prepare(cls, basis: SendBasis, items: Items, common: dict[str, Any], unique_for: object) -> ManySend:
        if unique_for is not None:
            raise InvalidOptionError(
                "send_many got unique_for without unique_keys: the window applies to keys; "
                "give unique_keys=[...] (one per item) or with_options(unique_key=...)"
            )
        spec, args_list, kwargs_list = basis.encode_items(items, common)
        return cls(basis, spec, new_task_ids(len(args_list)), args_list, kwargs_list)

    @property
    def empty(self) -> bool:
        return not self.ids

    def write(self, conn: Conn) -> None:
        tasks.insert_tasks(conn, self.spec, self.ids, self.args, self.kwargs, chunk=SEND_MANY_CHUNK)

    async def write_async(self, conn: AsyncConn) -> None:
        await tasks.insert_tasks_async(
            conn, self.spec, self.ids, self.args, self.kwargs, chunk=SEND_MANY_CHUNK
        )

    def handles(self) -> list[TaskHandle[Any]]:
        return [self.basis.handle(task_id) for task_id in self.ids]
