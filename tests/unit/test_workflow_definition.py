"""Unit tests for workflow definitions: every rule of app.workflow(...) / task.node(...), no database.

Each refusal is a WorkflowDefinitionError whose message names what is wrong and where: the
workflow, the node (by name, or by task while it has none) and the parameter. Building nodes
and workflows never connects: the app here points at a closed port, and every way tether
could open a connection is replaced by a trap for the whole module.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest

from tether import AppConfig, TaskError, TaskResult, Tether
from tether.broker.workflows import StepFeed
from tether.errors import WorkflowDefinitionError
from tether.workflow.definition import Node, Workflow

CLOSED_PORT_URL = "postgresql://nobody@127.0.0.1:1/nowhere"  # nothing listens on port 1


class Connected(AssertionError):
    """Raised by the traps: something tried to reach a database."""


@pytest.fixture(scope="module", autouse=True)
def no_database() -> Iterator[list[str]]:
    """TETHER_* cleared and the URL set to a closed port; every connection path is a trap."""
    attempts: list[str] = []

    def trap(what: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            attempts.append(what)
            raise Connected(f"building workflows must not touch the database ({what} was called)")

        return refuse

    import tether.db.embedded

    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.upper().startswith("TETHER_"):
                mp.delenv(name)
        mp.setenv("TETHER_DATABASE_URL", CLOSED_PORT_URL)
        mp.setattr(psycopg, "connect", trap("psycopg.connect"))
        mp.setattr(psycopg.Connection, "connect", trap("psycopg.Connection.connect"))
        mp.setattr(tether.db.embedded, "ensure_shared_server", trap("the embedded server"))
        yield attempts
    assert attempts == [], f"a connection was attempted: {attempts}"


def build_app() -> SimpleNamespace:
    """A local app with tasks of every parameter shape the rules care about."""
    app = Tether(AppConfig(queues=["default", "other"]))

    @app.task("t.add")
    def add(a: int, b: int = 0) -> TaskResult[int, TaskError]:
        return TaskResult(ok=a + b)

    @app.task("t.one")
    def one(x: int) -> TaskResult[int, TaskError]:
        return TaskResult(ok=x)

    @app.task("t.posonly")
    def posonly(x: int, /, y: int = 0) -> TaskResult[int, TaskError]:
        return TaskResult(ok=x + y)

    @app.task("t.star")
    def star(first: int = 0, *items: int, **extra: int) -> TaskResult[int, TaskError]:
        return TaskResult(ok=first + sum(items) + sum(extra.values()))

    @app.task("t.report")
    def report(upstream: TaskResult[int, TaskError]) -> TaskResult[str, TaskError]:
        return TaskResult(ok="ok" if upstream.is_ok else "err")

    @app.task("t.first")
    def first(a: int | None = None, b: int | None = None) -> TaskResult[int, TaskError]:
        return TaskResult(ok=a if a is not None else b if b is not None else -1)

    @app.task("t.noargs")
    def noargs() -> TaskResult[None, TaskError]:
        return TaskResult(ok=None)

    return SimpleNamespace(
        app=app, add=add, one=one, posonly=posonly, star=star, report=report, first=first, noargs=noargs
    )


@pytest.fixture(scope="module")
def t(no_database: list[str]) -> SimpleNamespace:
    return build_app()


def refused(build: Callable[[], object], *fragments: str) -> str:
    """``build()`` raises WorkflowDefinitionError whose message contains every fragment."""
    with pytest.raises(WorkflowDefinitionError) as info:
        build()
    message = str(info.value)
    missing = [f for f in fragments if f not in message]
    assert not missing, f"message {message!r} does not contain {missing}"
    return message


# -- what the app is: no database, nothing written ------------------------------------------------


def test_the_app_and_its_workflows_never_connect(t: SimpleNamespace, no_database: list[str]) -> None:
    assert t.app.config.broker.database_url == CLOSED_PORT_URL
    root = t.one.node(args=(1,), name="root")
    left = t.add.node(kwargs={"b": 1}, args_from={"a": root}, name="left")
    right = t.add.with_options(queue="other", priority=5).node(args=(2,), after=[root], name="right")
    end = t.report.node(args_from={"upstream": left}, after=[right], run_anyway=True, name="end")
    wf = t.app.workflow("offline", [root, left, right, end])
    wf.rows(uuid.uuid4())  # building the rows is pure too
    assert repr(wf) == "Workflow('offline', nodes=['root', 'left', 'right', 'end'])"
    assert no_database == []


def test_a_valid_definition_is_recorded_as_given(t: SimpleNamespace) -> None:
    root = t.one.node(args=(1,), name="root")
    left = t.add.node(kwargs={"b": 1}, args_from={"a": root}, name="left")
    right = t.add.with_options(queue="other", priority=5).node(args=(2,), after=[root, root], name="right")
    end = t.report.node(args_from={"upstream": left}, after=[right, "left"], run_anyway=True, name="end")
    wf = t.app.workflow("diamond", [root, left, right, end], on_error="pause")

    assert wf.names == ["root", "left", "right", "end"]
    assert wf.deps == [[], [0], [0], [2, 1]]  # after first, then args_from; each dependency once
    assert wf.dependents == [[1, 2], [3], [3], []]
    assert wf.feeds[1] == {"a": {"node": 0, "as": "value"}}
    assert wf.feeds[3] == {"upstream": {"node": 1, "as": "result"}}  # annotated TaskResult
    assert wf.output == 3  # the only final node
    assert wf.order.index(0) < wf.order.index(1) < wf.order.index(3)
    assert wf.order.index(2) < wf.order.index(3)

    workflow, steps = wf.rows(uuid.uuid4())
    assert workflow.on_error == "pause" and workflow.steps_total == 4 and workflow.output_node == 3
    assert [s.queue for s in steps] == ["default", "default", "other", "default"]
    assert steps[2].priority == 5
    assert steps[3].depends_on == [2, 1] and steps[3].run_anyway is True
    assert len({s.task_id for s in steps}) == 4
    # edges are stored by the task ids fixed at start: the engine looks steps up by that key
    ids = [s.task_id for s in steps]
    assert [s.dependents for s in steps] == [[ids[1], ids[2]], [ids[3]], [ids[3]], []]
    assert steps[1].args_from == {"a": StepFeed(node=0, task=ids[0], mode="value")}
    assert steps[3].args_from == {"upstream": StepFeed(node=1, task=ids[1], mode="result")}


def test_output_defaults_to_none_with_several_final_nodes_and_can_be_named(t: SimpleNamespace) -> None:
    root = t.one.node(args=(1,), name="root")
    a = t.add.node(args_from={"a": root}, name="a")
    b = t.add.node(args_from={"a": root}, name="b")
    assert t.app.workflow("two-sinks", [root, a, b]).output is None
    assert t.app.workflow("by-name", [root, a, b], output="b").output == 2
    assert t.app.workflow("by-node", [root, a, b], output=a).output == 1


# -- the node list ---------------------------------------------------------------------------------


def test_empty_node_list(t: SimpleNamespace) -> None:
    refused(lambda: t.app.workflow("empty", []), "workflow 'empty'", "non-empty list of nodes")
    refused(lambda: t.app.workflow("empty", ()), "workflow 'empty'", "non-empty list of nodes")


def test_a_single_node_instead_of_a_list(t: SimpleNamespace) -> None:
    refused(lambda: t.app.workflow("single", t.one.node(args=(1,))), "workflow 'single'", "list of nodes")


def test_something_that_is_not_a_node(t: SimpleNamespace) -> None:
    ok = t.one.node(args=(1,))
    refused(
        lambda: t.app.workflow("mixed", [ok, "t.one"]),
        "workflow 'mixed'",
        "item 1 of nodes is a str, not a node",
        "task.node(...)",
    )
    refused(lambda: t.app.workflow("mixed", [ok, t.one]), "workflow 'mixed'", "item 1", "Task")


def test_a_task_from_another_app(t: SimpleNamespace) -> None:
    other = Tether(AppConfig())

    @other.task("t.add")  # same name as a task of t.app: still not t.app's task
    def add(a: int) -> TaskResult[int, TaskError]:
        return TaskResult(ok=a)

    @other.task("elsewhere.only")
    def only() -> TaskResult[None, TaskError]:
        return TaskResult(ok=None)

    refused(
        lambda: t.app.workflow("foreign", [add.node(args=(1,), name="borrowed")]),
        "workflow 'foreign'",
        "node 'borrowed'",
        "task 't.add'",
        "not registered in this app",
    )
    refused(
        lambda: t.app.workflow("foreign", [t.one.node(args=(1,)), only.node()]),
        "workflow 'foreign'",
        "'elsewhere.only'",
        "not registered in this app",
    )


def test_a_node_listed_twice(t: SimpleNamespace) -> None:
    n = t.one.node(args=(1,), name="twice")
    refused(
        lambda: t.app.workflow("dup", [n, t.add.node(args=(2,)), n]),
        "workflow 'dup'",
        "'twice'",
        "listed twice",
    )
    unnamed = t.one.node(args=(1,))
    refused(lambda: t.app.workflow("dup", [unnamed, unnamed]), "workflow 'dup'", "'t.one'", "listed twice")


def test_two_nodes_with_the_same_explicit_name(t: SimpleNamespace) -> None:
    refused(
        lambda: t.app.workflow("names", [t.one.node(args=(1,), name="x"), t.add.node(args=(1,), name="x")]),
        "workflow 'names'",
        "two nodes are named 'x'",
    )


def test_an_explicit_name_that_is_another_nodes_default_name(t: SimpleNamespace) -> None:
    # 't.one' is the default name of the unnamed t.one node
    refused(
        lambda: t.app.workflow("names", [t.add.node(args=(1,), name="t.one"), t.one.node(args=(1,))]),
        "workflow 'names'",
        "'t.one'",
    )
    # the unnamed t.add nodes at positions 1 and 2 would be 't.add[1]' and 't.add[2]'
    refused(
        lambda: t.app.workflow(
            "names", [t.one.node(args=(1,), name="t.add[2]"), t.add.node(args=(1,)), t.add.node(args=(2,))]
        ),
        "workflow 'names'",
        "not unique",
        "'t.add[2]'",
    )


def test_default_names_for_unnamed_nodes(t: SimpleNamespace) -> None:
    wf = t.app.workflow(
        "defaults",
        [
            t.add.node(args=(1,)),
            t.one.node(args=(1,)),
            t.add.node(args=(2,)),
            t.add.node(args=(3,), name="mine"),
        ],
    )
    # alone, a node is named after its task; several unnamed nodes of one task, by position
    assert wf.names == ["t.add[0]", "t.one", "t.add[2]", "mine"]
    after_default = t.app.workflow(
        "defaults", [t.add.node(args=(1,)), t.add.node(args=(2,)), t.one.node(args=(1,), after=["t.add[1]"])]
    )
    assert after_default.deps[2] == [1]


def test_bad_node_names(t: SimpleNamespace) -> None:
    refused(lambda: t.add.node(args=(1,), name=""), "node name", "non-empty string", "''")
    refused(lambda: t.add.node(args=(1,), name="n" * 201), "node name", "up to 200 characters")
    refused(lambda: t.add.node(args=(1,), name=7), "node name", "got 7")  # type: ignore[arg-type]
    assert t.app.workflow("ok", [t.add.node(args=(1,), name="n" * 200)]).names == ["n" * 200]


# -- dependencies ----------------------------------------------------------------------------------


def test_a_dependency_not_in_the_list(t: SimpleNamespace) -> None:
    outside = t.one.node(args=(1,), name="outside")
    refused(
        lambda: t.app.workflow("deps", [t.add.node(args=(1,), after=[outside], name="inside")]),
        "workflow 'deps'",
        "node 'inside'",
        "Node('outside')",
        "not in this workflow's nodes",
    )
    refused(
        lambda: t.app.workflow(
            "deps", [t.one.node(args=(1,), name="r"), t.add.node(args_from={"a": outside}, name="inside")]
        ),
        "workflow 'deps'",
        "node 'inside'",
        "Node('outside')",
    )


def test_a_dependency_named_by_an_unknown_name(t: SimpleNamespace) -> None:
    message = refused(
        lambda: t.app.workflow(
            "deps", [t.one.node(args=(1,), name="r"), t.add.node(args=(1,), after=["ghost"], name="inside")]
        ),
        "workflow 'deps'",
        "node 'inside'",
        "'ghost'",
        "no node has that name",
    )
    assert message.endswith("nodes: r, inside")  # says which names exist
    refused(
        lambda: t.app.workflow(
            "deps", [t.one.node(args=(1,), name="r"), t.add.node(args_from={"a": "ghost"}, name="inside")]
        ),
        "node 'inside'",
        "'ghost'",
    )


def test_a_dependency_that_is_neither_node_nor_name(t: SimpleNamespace) -> None:
    refused(
        lambda: t.app.workflow(
            "deps", [t.one.node(args=(1,), name="r"), t.add.node(args=(1,), after=[3], name="n")]
        ),
        "workflow 'deps'",
        "node 'n'",
        "must be a node or a node name, got int",
    )
    refused(
        lambda: t.app.workflow(
            "deps", [t.one.node(args=(1,), name="r"), t.add.node(args_from={"a": 3.5}, name="n")]
        ),
        "node 'n'",
        "got float",
    )


def test_after_and_args_from_containers(t: SimpleNamespace) -> None:
    root = t.one.node(args=(1,), name="root")
    refused(
        lambda: t.add.node(args=(1,), after=root), "a node of task 't.add'", "after must be a list", "Node"
    )
    refused(lambda: t.add.node(args=(1,), after="root", name="n"), "node 'n'", "after must be a list", "str")
    refused(
        lambda: t.add.node(args_from=[("a", root)], name="n"),  # type: ignore[arg-type]
        "node 'n'",
        "args_from must be a dict",
        "list",
    )


def test_self_dependency(t: SimpleNamespace) -> None:
    refused(
        lambda: t.app.workflow("selfish", [t.add.node(args=(1,), after=["me"], name="me")]),
        "workflow 'selfish'",
        "node 'me' depends on itself",
    )
    refused(
        lambda: t.app.workflow("selfish", [t.add.node(args_from={"a": "me"}, name="me")]),
        "workflow 'selfish'",
        "node 'me' depends on itself",
    )


def test_a_cycle_given_by_names_is_shown(t: SimpleNamespace) -> None:
    message = refused(
        lambda: t.app.workflow(
            "loop",
            [
                t.add.node(args=(1,), after=["c"], name="a"),
                t.add.node(args=(1,), after=["a"], name="b"),
                t.add.node(args=(1,), after=["b"], name="c"),
            ],
        ),
        "workflow 'loop' has a cycle",
    )
    assert message.endswith("a -> c -> b -> a")  # each arrow: "depends on"


def test_a_cycle_is_shown_without_the_nodes_that_only_wait_for_it(t: SimpleNamespace) -> None:
    message = refused(
        lambda: t.app.workflow(
            "loop",
            [
                t.one.node(args=(1,), name="free"),
                t.add.node(args=(1,), after=["y"], name="downstream"),  # waits for the cycle, not in it
                t.add.node(args_from={"a": "z"}, after=["free"], name="x"),
                t.add.node(args=(1,), after=["x"], name="y"),
                t.add.node(args=(1,), after=["y"], name="z"),
            ],
        ),
        "workflow 'loop' has a cycle",
    )
    assert message.endswith("y -> x -> z -> y")
    assert "downstream" not in message and "free" not in message


# -- arguments -------------------------------------------------------------------------------------


def test_arguments_that_do_not_bind(t: SimpleNamespace) -> None:
    common = ("workflow 'args'", "node 'n'", "arguments do not fit task 't.add'", "signature: t.add(a:")
    refused(
        lambda: t.app.workflow("args", [t.add.node(name="n")]), *common, "missing a required argument: 'a'"
    )
    refused(
        lambda: t.app.workflow("args", [t.add.node(args=(1,), kwargs={"c": 2}, name="n")]),
        *common,
        "unexpected keyword argument 'c'",
    )
    refused(
        lambda: t.app.workflow("args", [t.add.node(args=(1, 2, 3), name="n")]), *common, "too many positional"
    )
    refused(
        lambda: t.app.workflow(
            "args", [t.one.node(args=(1,), name="r"), t.add.node(args=(1,), args_from={"a": "r"}, name="n")]
        ),
        *common,
        "multiple values for argument 'a'",
        "args_from: ['a']",
    )
    refused(
        lambda: t.app.workflow("args", [t.noargs.node(args=(1,), name="n")]),
        "node 'n'",
        "arguments do not fit task 't.noargs'",
    )


def test_args_and_kwargs_containers(t: SimpleNamespace) -> None:
    refused(lambda: t.add.node(args="12"), "a node of task 't.add'", "args must be a tuple or list", "str")
    refused(lambda: t.add.node(args=5, name="n"), "node 'n'", "args must be a tuple or list", "int")  # type: ignore[arg-type]
    refused(lambda: t.add.node(kwargs=[("a", 1)], name="n"), "node 'n'", "kwargs must be a dict", "list")  # type: ignore[arg-type]


def test_args_from_a_name_that_is_not_a_parameter(t: SimpleNamespace) -> None:
    refused(
        lambda: t.app.workflow(
            "feed", [t.one.node(args=(1,), name="r"), t.add.node(args_from={"c": "r"}, name="n")]
        ),
        "workflow 'feed'",
        "node 'n'",
        "args_from names 'c'",
        "not a parameter of task 't.add'",
        "(signature: t.add(a:",
    )


@pytest.mark.parametrize("param", ["items", "extra"])
def test_args_from_a_star_parameter(t: SimpleNamespace, param: str) -> None:
    refused(
        lambda: t.app.workflow(
            "feed", [t.one.node(args=(1,), name="r"), t.star.node(args_from={param: "r"}, name="n")]
        ),
        "workflow 'feed'",
        "node 'n'",
        f"args_from names {param!r}",
        "not a parameter of task 't.star'",
    )
    # the named parameter before them can be fed
    wf = t.app.workflow(
        "feed", [t.one.node(args=(1,), name="r"), t.star.node(args_from={"first": "r"}, name="n")]
    )
    assert wf.feeds[1] == {"first": {"node": 0, "as": "value"}}


def test_args_from_a_positional_only_parameter(t: SimpleNamespace) -> None:
    refused(
        lambda: t.app.workflow(
            "feed", [t.one.node(args=(1,), name="r"), t.posonly.node(args_from={"x": "r"}, name="n")]
        ),
        "workflow 'feed'",
        "node 'n'",
        "positional-only parameter 'x'",
    )
    wf = t.app.workflow(
        "feed", [t.one.node(args=(1,), name="r"), t.posonly.node(args=(1,), args_from={"y": "r"})]
    )
    assert wf.feeds[1] == {"y": {"node": 0, "as": "value"}}


def test_args_from_a_parameter_also_given_in_kwargs(t: SimpleNamespace) -> None:
    refused(
        lambda: t.app.workflow(
            "feed",
            [t.one.node(args=(1,), name="r"), t.add.node(kwargs={"a": 1}, args_from={"a": "r"}, name="n")],
        ),
        "workflow 'feed'",
        "node 'n'",
        "parameter 'a' is given both in kwargs and in args_from",
    )


@pytest.mark.parametrize(
    ("value", "fragments"),
    [
        (object(), ("args at [0]", "type object is not supported")),
        (lambda: 1, ("args at [0]", "tether never sends code")),
        ({1: "int key"}, ("args at [0]", "dict key 1")),
        (float("nan"), ("args at [0]", "nan")),
    ],
)
def test_unserialisable_arguments(t: SimpleNamespace, value: Any, fragments: tuple[str, ...]) -> None:
    refused(
        lambda: t.app.workflow("encode", [t.one.node(args=(value,), name="n")]),
        "workflow 'encode', node 'n'",
        *fragments,
    )


def test_naive_datetimes_are_refused_and_aware_ones_accepted(t: SimpleNamespace) -> None:
    refused(
        lambda: t.app.workflow(
            "encode", [t.add.node(args=(1,), kwargs={"b": datetime(2030, 1, 1)}, name="n")]
        ),
        "workflow 'encode', node 'n'",
        "kwargs at ['b']",
        "naive datetime",
    )
    aware = datetime(2030, 1, 1, tzinfo=UTC)
    wf = t.app.workflow("encode", [t.add.node(args=(1,), kwargs={"b": aware}, name="n")])
    assert wf.encoded[0][1]["b"] == {"__tether__": "datetime", "v": aware.isoformat()}


# -- joins, run_anyway, options --------------------------------------------------------------------


def test_join_any_without_dependencies(t: SimpleNamespace) -> None:
    refused(
        lambda: t.app.workflow("joins", [t.first.node(join="any", name="lonely")]),
        "workflow 'joins'",
        "node 'lonely'",
        "join='any' needs dependencies",
    )


def test_run_anyway_feeding_a_value_parameter_without_default(t: SimpleNamespace) -> None:
    refused(
        lambda: t.app.workflow(
            "anyway",
            [t.one.node(args=(1,), name="up"), t.one.node(args_from={"x": "up"}, run_anyway=True, name="n")],
        ),
        "workflow 'anyway'",
        "node 'n'",
        "run_anyway=True",
        "dependency 'up'",
        "parameter 'x' no value",
        "give 'x' a default",
        "TaskResult[...]",
    )


def test_run_anyway_with_a_default_or_a_task_result_parameter_is_allowed(t: SimpleNamespace) -> None:
    up = t.one.node(args=(1,), name="up")
    with_default = t.app.workflow("anyway", [up, t.add.node(args=(1,), args_from={"b": up}, run_anyway=True)])
    assert with_default.feeds[1] == {"b": {"node": 0, "as": "value"}}
    as_result = t.app.workflow("anyway", [up, t.report.node(args_from={"upstream": up}, run_anyway=True)])
    assert as_result.feeds[1] == {"upstream": {"node": 0, "as": "result"}}


def test_join_any_needs_defaults_even_for_task_result_parameters(t: SimpleNamespace) -> None:
    a, b = t.one.node(args=(1,), name="a"), t.one.node(args=(2,), name="b")
    message = refused(
        lambda: t.app.workflow(
            "any", [a, b, t.report.node(args_from={"upstream": a}, after=[b], join="any", name="n")]
        ),
        "workflow 'any'",
        "node 'n'",
        "join='any'",
        "dependency 'a'",
        "give 'upstream' a default",
    )
    assert "TaskResult[...]" not in message  # annotating would not help: 'a' may never finish
    refused(
        lambda: t.app.workflow("any", [a, b, t.add.node(args_from={"a": a, "b": b}, join="any", name="n")]),
        "node 'n'",
        "parameter 'a' no value",
    )
    wf = t.app.workflow("any", [a, b, t.first.node(args_from={"a": a, "b": b}, join="any", name="n")])
    assert wf.deps[2] == [0, 1]


@pytest.mark.parametrize("join", ["some", "ALL", None, ""])
def test_invalid_join(t: SimpleNamespace, join: Any) -> None:
    refused(
        lambda: t.add.node(args=(1,), join=join, name="n"),
        "node 'n'",
        "join must be 'all' or 'any'",
        repr(join),
    )
    refused(lambda: t.add.node(args=(1,), join=join), "a node of task 't.add'", "join must be")


@pytest.mark.parametrize("on_error", ["ignore", "FAIL", None])
def test_invalid_on_error(t: SimpleNamespace, on_error: Any) -> None:
    refused(
        lambda: t.app.workflow("policy", [t.one.node(args=(1,))], on_error=on_error),
        "workflow 'policy'",
        "on_error must be 'fail' or 'pause'",
        repr(on_error),
    )


def test_run_anyway_must_be_a_bool(t: SimpleNamespace) -> None:
    refused(
        lambda: t.add.node(args=(1,), run_anyway=1, name="n"), "node 'n'", "run_anyway must be True or False"
    )  # type: ignore[arg-type]


def test_good_until_is_refused_for_steps(t: SimpleNamespace) -> None:
    later = datetime.now(UTC) + timedelta(hours=1)
    refused(
        lambda: t.add.with_options(good_until=later).node(args=(1,), name="n"),
        "node 'n'",
        "good_until does not apply to workflow steps",
        "cancel the workflow",
    )
    refused(
        lambda: t.add.with_options(good_until=later).node(args=(1,)), "a node of task 't.add'", "good_until"
    )
    # other options are fine
    node = t.add.with_options(queue="other", priority=-3).node(args=(1,))
    assert (node.options.queue, node.options.priority) == ("other", -3)


# -- output and the workflow's own name ------------------------------------------------------------


def test_an_output_node_not_in_the_workflow(t: SimpleNamespace) -> None:
    inside = t.one.node(args=(1,), name="inside")
    refused(
        lambda: t.app.workflow("out", [inside], output=t.one.node(args=(2,), name="outside")),
        "workflow 'out'",
        "output names Node('outside')",
        "not in this workflow's nodes",
    )
    refused(
        lambda: t.app.workflow("out", [inside], output="outside"),
        "workflow 'out'",
        "output names 'outside'",
        "nodes: inside",
    )
    refused(
        lambda: t.app.workflow("out", [inside], output=0), "workflow 'out'", "output must be a node", "int"
    )  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["", "w" * 201, 7, None])
def test_bad_workflow_name(t: SimpleNamespace, name: Any) -> None:
    refused(
        lambda: t.app.workflow(name, [t.one.node(args=(1,))]),
        "workflow name must be a non-empty string of up to 200 characters",
        f"got {name!r}"[:60],
    )


def test_workflow_name_bounds(t: SimpleNamespace) -> None:
    assert t.app.workflow("w" * 200, [t.one.node(args=(1,))]).name == "w" * 200
    assert isinstance(Workflow(t.app, "direct", [t.one.node(args=(1,))]), Workflow)


def test_a_hand_built_node_of_this_app_is_accepted(t: SimpleNamespace) -> None:
    node = Node(task=t.one, options=t.one.options, args=(1,), name="hand")
    assert t.app.workflow("hand", [node]).names == ["hand"]
