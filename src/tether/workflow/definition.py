"""Building a workflow: nodes, their dependencies and data flow, checked before anything is written.

A workflow is a list of nodes. Each node is one task call with fixed arguments;
it may wait for other nodes (``after``), take their results as arguments
(``args_from``, which implies waiting for them), wait for all of them
(``join="all"``, the default) or for the first to complete (``join="any"``),
and ask to run even when a dependency did not complete (``run_anyway``).
Everything a caller can get wrong is refused by ``Workflow(...)`` with a
WorkflowDefinitionError naming the node and the problem.
"""

from __future__ import annotations

import inspect
import json
import typing
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypedDict

from tether import codec, tracing
from tether.app_view import AppView
from tether.broker.types import AsyncCallerConn, CallerConn
from tether.broker.workflows import NewStep, NewWorkflow, StepFeed
from tether.caller_transaction import check_connection, run_in, run_in_async
from tether.config import RetryPolicy
from tether.errors import InvalidOptionError, SerializationError, WorkflowDefinitionError
from tether.ids import new_task_id, new_task_ids
from tether.limits import check_concurrency_key
from tether.offload import in_thread
from tether.options import SendOptions
from tether.result import TaskResult
from tether.workflow import engine
from tether.workflow.handle import WorkflowHandle

Join = Literal["all", "any"]
OnError = Literal["fail", "pause"]
_NAME_MAX = 200


class NodeOptions(TypedDict, total=False):
    """The keyword arguments of ``task.node(...)``; see make_node."""

    args: Sequence[Any]
    kwargs: Mapping[str, Any] | None
    name: str | None
    after: Sequence[Node | str]
    args_from: Mapping[str, Node | str] | None
    join: Join
    run_anyway: bool


class StepTask(Protocol):
    """What a workflow step uses of its task (a ``tether.task.Task``).

    A Protocol rather than the Task class: task.py imports this module to build nodes.
    """

    @property
    def name(self) -> str: ...

    @property
    def fn(self) -> Callable[..., Any]: ...

    @property
    def signature(self) -> inspect.Signature: ...

    @property
    def retry_policy(self) -> RetryPolicy | None: ...


@dataclass(frozen=True, eq=False)
class Node:
    """One step of a workflow: a task, its arguments and what it waits for.

    Build it with ``task.node(...)`` (or ``task.with_options(...).node(...)`` for
    another queue or priority). Dependencies are other nodes, or node names.
    """

    task: StepTask
    options: SendOptions
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    name: str | None = None
    after: tuple[Node | str, ...] = ()
    args_from: Mapping[str, Node | str] = field(default_factory=dict)
    join: Join = "all"
    run_anyway: bool = False

    def __repr__(self) -> str:
        return f"Node({self.name or self.task.name!r})"


def make_node(
    task: StepTask,
    options: SendOptions,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    name: str | None = None,
    after: Sequence[Node | str] = (),
    args_from: Mapping[str, Node | str] | None = None,
    join: Join = "all",
    run_anyway: bool = False,
) -> Node:
    what = f"node {name!r}" if name else f"a node of task {task.name!r}"
    if isinstance(args, str | bytes) or not isinstance(args, Sequence):
        raise WorkflowDefinitionError(f"{what}: args must be a tuple or list, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise WorkflowDefinitionError(f"{what}: kwargs must be a dict, got {type(kwargs).__name__}")
    if isinstance(after, str | Node) or not isinstance(after, Sequence):
        raise WorkflowDefinitionError(
            f"{what}: after must be a list of nodes or node names, got {type(after).__name__}"
        )
    if args_from is not None and not isinstance(args_from, Mapping):
        raise WorkflowDefinitionError(
            f"{what}: args_from must be a dict of parameter name -> node, got {type(args_from).__name__}"
        )
    if join not in ("all", "any"):
        raise WorkflowDefinitionError(f"{what}: join must be 'all' or 'any', got {join!r}")
    if not isinstance(run_anyway, bool):
        raise WorkflowDefinitionError(f"{what}: run_anyway must be True or False, got {run_anyway!r}")
    if options.good_until is not None:
        raise WorkflowDefinitionError(
            f"{what}: good_until does not apply to workflow steps (a step waits for its "
            "dependencies for as long as they take); cancel the workflow instead"
        )
    if name is not None and (not isinstance(name, str) or not name or len(name) > _NAME_MAX):
        raise WorkflowDefinitionError(
            f"node name must be a non-empty string of up to {_NAME_MAX} characters, got {name!r}"
        )
    return Node(
        task=task,
        options=options,
        args=tuple(args),
        kwargs=dict(kwargs or {}),
        name=name,
        after=tuple(after),
        args_from=dict(args_from or {}),
        join=join,
        run_anyway=run_anyway,
    )


class Workflow:
    """A validated workflow definition; ``start()`` runs one instance of it."""

    def __init__(
        self,
        app: AppView,
        name: str,
        nodes: Sequence[Node],
        *,
        on_error: OnError = "fail",
        output: Node | str | None = None,
    ) -> None:
        if not isinstance(name, str) or not name or len(name) > _NAME_MAX:
            raise WorkflowDefinitionError(
                f"workflow name must be a non-empty string of up to {_NAME_MAX} characters, got {name!r}"
            )
        if on_error not in ("fail", "pause"):
            raise WorkflowDefinitionError(
                f"workflow {name!r}: on_error must be 'fail' or 'pause', got {on_error!r}"
            )
        if isinstance(nodes, Node) or not isinstance(nodes, Sequence) or not nodes:
            raise WorkflowDefinitionError(f"workflow {name!r}: nodes must be a non-empty list of nodes")
        self.app = app
        self.name = name
        self.on_error: OnError = on_error
        self.nodes: tuple[Node, ...] = tuple(nodes)
        self.names = _node_names(name, self.nodes, app)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.deps: list[list[int]] = [self._deps(i, node) for i, node in enumerate(self.nodes)]
        self.order = _topological(name, self.names, self.deps)
        self.dependents: list[list[int]] = [[] for _ in self.nodes]
        for i, deps in enumerate(self.deps):
            for d in deps:
                self.dependents[d].append(i)
        self.feeds = [self._feeds(i, node) for i, node in enumerate(self.nodes)]
        self.encoded = [self._encode(i, node) for i, node in enumerate(self.nodes)]
        self.keys = [self._key(i, node) for i, node in enumerate(self.nodes)]
        self.output = None if output is None else self._ref(None, output, "output")
        if self.output is None:
            sinks = [i for i, d in enumerate(self.dependents) if not d]
            self.output = sinks[0] if len(sinks) == 1 else None

    def __repr__(self) -> str:
        return f"Workflow({self.name!r}, nodes={list(self.names)})"

    # -- checks -----------------------------------------------------------------

    def _ref(self, at: int | None, ref: object, role: str) -> int:
        where = f"workflow {self.name!r}" + ("" if at is None else f", node {self.names[at]!r}")
        if isinstance(ref, Node):
            for i, node in enumerate(self.nodes):
                if node is ref:
                    return i
            raise WorkflowDefinitionError(
                f"{where}: {role} names {ref!r}, which is not in this workflow's nodes; add it to the list"
            )
        if isinstance(ref, str):
            if ref in self.index:
                return self.index[ref]
            raise WorkflowDefinitionError(
                f"{where}: {role} names {ref!r}, but no node has that name; nodes: {', '.join(self.names)}"
            )
        raise WorkflowDefinitionError(
            f"{where}: {role} must be a node or a node name, got {type(ref).__name__}"
        )

    def _deps(self, i: int, node: Node) -> list[int]:
        deps: list[int] = []
        for ref in (*node.after, *node.args_from.values()):
            d = self._ref(i, ref, "a dependency")
            if d == i:
                raise WorkflowDefinitionError(
                    f"workflow {self.name!r}: node {self.names[i]!r} depends on itself"
                )
            if d not in deps:
                deps.append(d)
        if node.join == "any" and not deps:
            raise WorkflowDefinitionError(
                f"workflow {self.name!r}, node {self.names[i]!r}: join='any' needs dependencies"
            )
        return deps

    def _feeds(self, i: int, node: Node) -> dict[str, dict[str, Any]]:
        """args_from by node: {param: {"node": n, "as": "value" | "result"}} (rows() adds the task id)."""
        where = f"workflow {self.name!r}, node {self.names[i]!r}"
        params = node.task.signature.parameters
        try:
            hints = typing.get_type_hints(node.task.fn)
        except Exception:  # unresolvable annotations: every parameter takes the plain value
            hints = {}
        feeds: dict[str, dict[str, Any]] = {}
        for pname, ref in node.args_from.items():
            param = params.get(pname)
            if param is None or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise WorkflowDefinitionError(
                    f"{where}: args_from names {pname!r}, which is not a parameter of task "
                    f"{node.task.name!r} (signature: {node.task.name}{node.task.signature})"
                )
            if param.kind is param.POSITIONAL_ONLY:
                raise WorkflowDefinitionError(
                    f"{where}: args_from cannot feed positional-only parameter {pname!r}"
                )
            if pname in node.kwargs:
                raise WorkflowDefinitionError(
                    f"{where}: parameter {pname!r} is given both in kwargs and in args_from"
                )
            mode = "result" if _is_task_result(hints.get(pname)) else "value"
            # When can this parameter be left without a value? A dependency that did not
            # complete gives no value; with join='any' one may not have finished at all.
            may_miss = node.join == "any" or (mode == "value" and node.run_anyway)
            if may_miss and param.default is inspect.Parameter.empty:
                why = "join='any'" if node.join == "any" else "run_anyway=True"
                raise WorkflowDefinitionError(
                    f"{where}: with {why}, dependency {self.names[self._ref(i, ref, 'args_from')]!r} "
                    f"may give parameter {pname!r} no value; give {pname!r} a default"
                    + ("" if mode == "result" else ", or annotate it as TaskResult[...] to get failures too")
                )
            feeds[pname] = {"node": self._ref(i, ref, "args_from"), "as": mode}
        try:
            placeholders = dict.fromkeys(feeds)
            node.task.signature.bind(*node.args, **node.kwargs, **placeholders)
        except TypeError as exc:
            raise WorkflowDefinitionError(
                f"{where}: arguments do not fit task {node.task.name!r}: {exc} "
                f"(signature: {node.task.name}{node.task.signature}; args_from: {sorted(feeds) or 'none'})"
            ) from None
        return feeds

    def _encode(self, i: int, node: Node) -> tuple[Any, Any]:
        what = f"workflow {self.name!r}, node {self.names[i]!r}"
        try:
            args = codec.dumps(list(node.args), what=f"{what}: args")
            kwargs = codec.dumps(dict(node.kwargs), what=f"{what}: kwargs")
        except SerializationError as exc:
            raise WorkflowDefinitionError(str(exc)) from None
        # Parsed as plain JSON (tags kept): the steps travel inside one JSON document.
        return json.loads(args), json.loads(kwargs)

    def _key(self, i: int, node: Node) -> str | None:
        """The step's concurrency key (docs/limits.md): its options' (``with_options(
        concurrency_key=...)``), else the value of the argument its task declares, from the
        node's own arguments. An argument fed by another step (args_from) is not known
        until that step finishes: such a step has no key unless one is given."""
        if node.options.concurrency_key is not None:
            return node.options.concurrency_key
        arg: str | None = getattr(node.task, "concurrency_key_arg", None)
        if arg is None or arg in node.args_from:
            return None
        try:
            bound = node.task.signature.bind_partial(*node.args, **node.kwargs)
        except TypeError:
            return None  # the encoding above names what does not fit
        bound.apply_defaults()
        value = bound.arguments.get(arg)
        if value is None:
            return None
        try:
            return check_concurrency_key(
                value, f"argument {arg!r} of task {node.task.name!r} (its concurrency key)"
            )
        except InvalidOptionError as exc:
            raise WorkflowDefinitionError(f"workflow {self.name!r}, node {self.names[i]!r}: {exc}") from None

    # -- starting ---------------------------------------------------------------

    def rows(self, workflow_id: uuid.UUID) -> tuple[NewWorkflow, list[NewStep]]:
        task_ids = new_task_ids(len(self.nodes))
        steps = []
        for i, node in enumerate(self.nodes):
            policy = node.task.retry_policy
            args, kwargs = self.encoded[i]
            steps.append(
                NewStep(
                    node=i,
                    node_name=self.names[i],
                    task_id=str(task_ids[i]),
                    task_name=node.task.name,
                    queue=node.options.queue,
                    priority=node.options.priority,
                    args=args,
                    kwargs=kwargs,
                    # Dependencies by task id too: advancing looks steps up by that single-column
                    # key, which no plan can widen into a range over the workflow.
                    args_from={
                        param: StepFeed(feed["node"], str(task_ids[feed["node"]]), feed["as"])
                        for param, feed in self.feeds[i].items()
                    },
                    max_retries=policy.max_retries if policy else 0,
                    retry_policy=policy.to_json() if policy else None,
                    depends_on=self.deps[i],
                    dependents=[str(task_ids[j]) for j in self.dependents[i]],
                    join_mode=node.join,
                    run_anyway=node.run_anyway,
                    unique_key=node.options.unique_key,
                    concurrency_key=self.keys[i],
                    unique_for_s=(
                        None if node.options.unique_for is None else node.options.unique_for.total_seconds()
                    ),
                )
            )
        workflow = NewWorkflow(
            id=workflow_id,
            name=self.name,
            on_error=self.on_error,
            output_node=self.output,
            steps_total=len(self.nodes),
        )
        return workflow, steps

    def start(self, *, connection: CallerConn | AsyncCallerConn | None = None) -> WorkflowHandle:
        """Write the workflow and enqueue its first steps (one transaction).

        ``connection``: your psycopg 3 connection with a transaction open; the workflow is
        written in that transaction and commits or rolls back with it (docs/transactions.md).
        """
        workflow_id = new_task_id()
        workflow, steps = self.rows(workflow_id)

        def write() -> None:
            if connection is None:
                self.app.broker.run(lambda conn: engine.start(conn, workflow, steps), idempotent_insert=True)
            else:
                lent = check_connection(connection)
                run_in(
                    self.app.broker, lent, "start()", lambda conn: engine.write_start(conn, workflow, steps)
                )

        if self.app.config.tracing:
            tracing.traced_start(self.name, workflow_id, write)
        else:
            write()
        return WorkflowHandle(self.app, workflow_id, self.name)

    async def start_async(self, *, connection: CallerConn | AsyncCallerConn | None = None) -> WorkflowHandle:
        """start(), for async code; ``connection`` is then a psycopg AsyncConnection."""
        if connection is None:
            return await in_thread(self.start)
        lent = check_connection(connection)
        workflow_id = new_task_id()
        workflow, steps = self.rows(workflow_id)

        async def write() -> None:
            await run_in_async(
                self.app.broker,
                lent,
                "start_async()",
                lambda conn: engine.write_start_async(conn, workflow, steps),
            )

        if self.app.config.tracing:
            await tracing.traced_start_async(self.name, workflow_id, write)
        else:
            await write()
        return WorkflowHandle(self.app, workflow_id, self.name)


def _node_names(workflow: str, nodes: Sequence[Node], app: AppView) -> list[str]:
    names: list[str] = []
    for i, node in enumerate(nodes):
        if not isinstance(node, Node):
            raise WorkflowDefinitionError(
                f"workflow {workflow!r}: item {i} of nodes is a {type(node).__name__}, not a node; "
                "build nodes with task.node(...)"
            )
        if app.tasks.get(node.task.name) is not node.task:
            raise WorkflowDefinitionError(
                f"workflow {workflow!r}: node {node.name or node.task.name!r} runs task "
                f"{node.task.name!r}, which is not registered in this app"
            )
        if node in nodes[:i]:
            raise WorkflowDefinitionError(f"workflow {workflow!r}: node {node!r} is listed twice")
        names.append(node.name or node.task.name)
    seen: dict[str, int] = {}
    for n in names:
        seen[n] = seen.get(n, 0) + 1
    for i, node in enumerate(nodes):
        if seen[names[i]] > 1:
            if node.name is not None:
                raise WorkflowDefinitionError(f"workflow {workflow!r}: two nodes are named {node.name!r}")
            names[i] = f"{node.task.name}[{i}]"  # unnamed nodes of the same task: by position
    if len(set(names)) != len(names):
        raise WorkflowDefinitionError(f"workflow {workflow!r}: node names are not unique: {names}")
    return names


def _topological(workflow: str, names: Sequence[str], deps: Sequence[Sequence[int]]) -> list[int]:
    """Kahn's algorithm; a leftover means a cycle, reported by its node names."""
    waiting = [len(d) for d in deps]
    dependents: list[list[int]] = [[] for _ in names]
    for i, ds in enumerate(deps):
        for d in ds:
            dependents[d].append(i)
    ready = [i for i, n in enumerate(waiting) if n == 0]
    order: list[int] = []
    while ready:
        i = ready.pop()
        order.append(i)
        for j in dependents[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                ready.append(j)
    if len(order) < len(names):
        cycle = _find_cycle(deps, {i for i in range(len(names)) if i not in order})
        raise WorkflowDefinitionError(
            f"workflow {workflow!r} has a cycle: {' -> '.join(names[i] for i in cycle)}"
        )
    return order


def _find_cycle(deps: Sequence[Sequence[int]], left: set[int]) -> list[int]:
    """One cycle among the nodes Kahn's algorithm could not order (each has a dependency in ``left``)."""
    start = min(left)
    path = [start]
    seen = {start: 0}
    node = start
    while True:
        node = next(d for d in deps[node] if d in left)
        if node in seen:
            return [*path[seen[node] :], node]
        seen[node] = len(path)
        path.append(node)


def _is_task_result(hint: Any) -> bool:
    return hint is TaskResult or typing.get_origin(hint) is TaskResult
