"""Counts and task lists that stay fast on a large history (docs/operations.md#counts-on-a-large-database).

- Counts per queue and status: exact on a small table; on a large one the finished statuses
  (and PENDING beyond a bound) are estimated from a sample of the table's pages and say so,
  while what waits (up to the bound) and what runs is counted exactly; ``exact`` counts all.
- Task lists read at most a bounded number of rows per page: pages of a filter that few
  rows match go back through the whole history, every match once, newest first, and a page
  that stopped at its bound says how far it searched.

The "large" table here is a few thousand rows read with a small sample or scan bound (the
module constants, lowered for the test), which exercises the same statements as ten million.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

import tether.cli
from tests.integration.test_dashboard import get, serve
from tether import PostgresConfig
from tether.broker import PostgresBroker, browse, counts
from tether.broker.browse import TaskFilter, browse_tasks, page_params
from tether.broker.queries import q
from tether.broker.queues import queue_overview
from tether.result import TaskStatus

Conn = psycopg.Connection[Any]

# 12,000 tasks made one second apart (UUIDv7 from their time): queues a (most), b, and rare
# (every 150th); the newest 1,500 PENDING at priorities 0, 5 and 10, some due later; the
# others by a hash of their number: 4 % FAILED (1 in 20 of them with a rare code), 1 %
# CANCELLED, 0.2 % in flight, the rest COMPLETED.
HISTORY = """
INSERT INTO tether_tasks (id, name, queue, priority, status, error_code, args, run_at, sent_at,
                          enqueued_at, claimed_at, started_at, updated_at, claimed_by_worker_id)
SELECT (lpad(to_hex((extract(epoch FROM ts) * 1000)::bigint), 12, '0') || '7'
        || substr(h, 1, 3) || '8' || substr(h, 4, 15))::uuid,
       CASE WHEN i % 3 = 0 THEN 'resize' ELSE 'mail' END,
       CASE WHEN i % 150 = 5 THEN 'rare' WHEN i % 4 = 1 THEN 'b' ELSE 'a' END,
       CASE WHEN st = 'PENDING' THEN (i % 3) * 5 ELSE 0 END,
       st,
       CASE st WHEN 'FAILED' THEN CASE WHEN r / 1000 % 20 = 0 THEN 'RARE_CODE' ELSE 'TIMEOUT' END
               WHEN 'CANCELLED' THEN 'TASK_CANCELLED' END,
       jsonb_build_array(i, repeat('x', 200)),
       CASE WHEN st = 'PENDING' AND i % 7 = 0 THEN now() + interval '1 hour' ELSE ts END,
       ts, ts,
       CASE WHEN st IN ('CLAIMED', 'RUNNING') THEN now() END,
       CASE WHEN st = 'RUNNING' THEN now() END,
       ts,
       CASE WHEN st IN ('CLAIMED', 'RUNNING') THEN 'w-1' END
FROM (SELECT i, r, md5(i::text) AS h, now() - interval '1 day' + i * interval '1 second' AS ts,
             CASE WHEN i > 10500 THEN 'PENDING'
                  WHEN r % 1000 < 1 THEN 'RUNNING' WHEN r % 1000 < 2 THEN 'CLAIMED'
                  WHEN r % 1000 < 42 THEN 'FAILED' WHEN r % 1000 < 52 THEN 'CANCELLED'
                  ELSE 'COMPLETED' END AS st
      FROM (SELECT i, abs(hashint8(i)) AS r FROM generate_series(1, 12000) AS i) AS numbered) AS made
"""
SAMPLE_PAGES = 40  # of the table's ~500 pages: the estimates read 8 % of it
CAP = 500  # PENDING counted exactly up to this per queue


@pytest.fixture
def history(db: Conn) -> Iterator[Conn]:
    db.execute(HISTORY)
    db.execute("ANALYZE tether_tasks")
    yield db


def actual_counts(conn: Conn) -> dict[tuple[str, str], int]:
    rows = conn.execute("SELECT queue, status, count(*) AS n FROM tether_tasks GROUP BY 1, 2").fetchall()
    return {(r["queue"], r["status"]): r["n"] for r in rows}


def pages(conn: Conn) -> int:
    row = conn.execute(
        "SELECT pg_relation_size('tether_tasks') / current_setting('block_size')::int AS n"
    ).fetchone()
    assert row is not None
    return int(row["n"])


# -- counts ----------------------------------------------------------------------------------------


def test_a_table_smaller_than_the_sample_is_counted_exactly(history: Conn) -> None:
    assert pages(history) < counts.SAMPLE_PAGES  # the default sample is the whole table here
    found = counts.queue_counts(history)
    assert {(c.queue, c.status.value): c.n for c in found} == actual_counts(history)
    assert not any(c.estimated for c in found)


def test_on_a_large_table_history_is_estimated_and_what_waits_and_runs_is_exact(history: Conn) -> None:
    assert pages(history) > 5 * SAMPLE_PAGES
    actual = actual_counts(history)
    found = {
        (c.queue, c.status.value): c
        for c in counts.queue_counts(history, sample_pages=SAMPLE_PAGES, pending_exact_up_to=CAP)
    }
    for (queue, status), count in found.items():
        real = actual.get((queue, status), 0)
        if status in ("CLAIMED", "RUNNING") or (status == "PENDING" and real <= CAP):
            assert (count.n, count.estimated) == (real, False), (queue, status)
        elif status == "PENDING":  # over the bound: estimated, never below it
            # (no closer check: the waiting rows are the newest, all in the table's last
            # pages, so a sample of 40 pages holds few of them)
            assert count.estimated and count.n >= CAP, (queue, status, count)
        else:
            assert count.estimated, (queue, status)
            if real >= 1000:  # a sample of 8 % of the pages tells the large ones within a third
                assert abs(count.n - real) <= 0.3 * real, (queue, status, count.n, real)
    # Every live count is there, whatever the sample saw.
    for queue, status in actual:
        if status in ("PENDING", "CLAIMED", "RUNNING"):
            assert (queue, status) in found, (queue, status)
    assert found[("a", "PENDING")].n > CAP and found[("a", "PENDING")].estimated
    assert not found[("rare", "PENDING")].estimated


def test_exact_counts_every_row_of_a_large_table(history: Conn) -> None:
    found = counts.queue_counts(history, exact=True, sample_pages=SAMPLE_PAGES, pending_exact_up_to=CAP)
    assert {(c.queue, c.status.value): c.n for c in found} == actual_counts(history)
    assert not any(c.estimated for c in found)


def test_estimates_are_rounded_to_two_significant_digits() -> None:
    assert [counts.rounded(n) for n in (7, 99, 100, 1234, 56_789, 9_876_543)] == [
        7,
        99,
        100,
        1200,
        57_000,
        9_900_000,
    ]


def test_the_queue_overview_names_its_estimates_and_finds_the_oldest_due_task(history: Conn) -> None:
    infos = {i.queue: i for i in queue_overview(history, ["declared"])}
    assert set(infos) == {"a", "b", "rare", "declared"}
    assert infos["declared"].counts == dict.fromkeys((s.value for s in TaskStatus), 0)
    assert infos["declared"].oldest_pending_age_s is None and infos["declared"].estimated == ()
    for queue in ("a", "b", "rare"):
        row = history.execute(
            "SELECT extract(epoch FROM now() - min(run_at) FILTER (WHERE run_at <= now()))::float8 AS age"
            " FROM tether_tasks WHERE status = 'PENDING' AND queue = %s",
            (queue,),
        ).fetchone()
        assert row is not None
        got = infos[queue].oldest_pending_age_s
        assert got is not None and abs(got - row["age"]) < 5, (queue, got, row["age"])
        assert infos[queue].estimated == ()  # the whole table is the sample here

    # A queue whose PENDING tasks are all due later has no due task; priorities apart.
    history.execute(
        "UPDATE tether_tasks SET run_at = now() + interval '1 hour'"
        " WHERE queue = 'rare' AND status = 'PENDING'"
    )
    assert {i.queue: i for i in queue_overview(history)}["rare"].oldest_pending_age_s is None


def test_the_queue_overview_of_a_large_table(history: Conn, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(counts, "SAMPLE_PAGES", SAMPLE_PAGES)
    monkeypatch.setattr(counts, "PENDING_EXACT_UP_TO", CAP)
    infos = {i.queue: i for i in queue_overview(history)}
    assert set(infos["a"].estimated) >= {"COMPLETED", "PENDING"}
    assert "CLAIMED" not in infos["a"].estimated and "PENDING" not in infos["rare"].estimated
    exact = {i.queue: i for i in queue_overview(history, exact=True)}
    assert all(i.estimated == () for i in exact.values())
    actual = actual_counts(history)
    assert exact["a"].counts["COMPLETED"] == actual[("a", "COMPLETED")]


def test_the_commands_mark_estimates_and_count_exactly_when_asked(
    history: Conn, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(counts, "SAMPLE_PAGES", SAMPLE_PAGES)
    monkeypatch.setattr(counts, "PENDING_EXACT_UP_TO", CAP)
    runner = CliRunner()
    actual = actual_counts(history)
    for command in ("status", "queues"):
        shown = runner.invoke(tether.cli.cli, [command, "--database-url", database_url])
        assert shown.exit_code == 0, shown.output
        assert "~" in shown.stdout and "estimated from a sample" in shown.stdout, command
        exact = runner.invoke(tether.cli.cli, [command, "--exact", "--database-url", database_url])
        assert exact.exit_code == 0, exact.output
        assert "~" not in exact.stdout and "estimated" not in exact.stdout, command
        assert str(actual[("a", "COMPLETED")]) in exact.stdout
    as_json = runner.invoke(tether.cli.cli, ["status", "--json", "--database-url", database_url])
    listed = {(c["queue"], c["status"]): c for c in json.loads(as_json.stdout)["counts"]}
    assert listed[("a", "COMPLETED")]["estimated"] is True
    assert listed[("a", "CLAIMED")] == {
        "queue": "a",
        "status": "CLAIMED",
        "n": actual[("a", "CLAIMED")],
        "estimated": False,
    }
    queues = json.loads(
        runner.invoke(tether.cli.cli, ["queues", "--json", "--database-url", database_url]).stdout
    )
    assert "COMPLETED" in {q["queue"]: q for q in queues}["a"]["estimated"]


def test_the_dashboard_sends_which_counts_are_estimates(
    history: Conn, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(counts, "SAMPLE_PAGES", SAMPLE_PAGES)
    broker = PostgresBroker(PostgresConfig(database_url=database_url))
    server = serve(broker)
    try:
        status, _, body = get(server.url + "api/status")
        assert status == 200
        shown = {(c["queue"], c["status"]): c for c in json.loads(body)["counts"]}
        assert shown[("a", "COMPLETED")]["estimated"] is True
        assert shown[("a", "CLAIMED")]["estimated"] is False
        status, _, body = get(server.url + "api/queues")
        assert status == 200
        assert "COMPLETED" in {q["queue"]: q for q in json.loads(body)["queues"]}["a"]["estimated"]
    finally:
        server.shutdown()
        server.server_close()
        broker.close()


# -- task lists ------------------------------------------------------------------------------------


def matching(conn: Conn, where: TaskFilter) -> list[uuid.UUID]:
    """Every task ``where`` matches, newest first, read without any bound."""
    rows = conn.execute(
        "SELECT id FROM tether_tasks WHERE (%(s)s::text[] IS NULL OR status = ANY(%(s)s::text[]))"
        " AND (%(q)s::text IS NULL OR queue = %(q)s) AND (%(n)s::text IS NULL OR name = %(n)s)"
        " AND (%(c)s::text IS NULL OR error_code = %(c)s)"
        " AND (%(lo)s::uuid IS NULL OR id >= %(lo)s::uuid) AND id < %(hi)s::uuid ORDER BY id DESC",
        {
            "s": list(where.statuses) or None,
            "q": where.queue,
            "n": where.name,
            "c": where.error_code,
            "lo": None if where.since is None else browse.id_floor(where.since),
            "hi": browse.TOP if where.until is None else browse.id_floor(where.until),
        },
    ).fetchall()
    return [r["id"] for r in rows]


FILTERS = [
    TaskFilter(),
    TaskFilter(queue="rare"),
    TaskFilter(name="resize", queue="b"),
    TaskFilter(statuses=(TaskStatus.PENDING,)),
    TaskFilter(statuses=(TaskStatus.PENDING,), queue="rare"),
    TaskFilter(statuses=(TaskStatus.FAILED,)),
    TaskFilter(statuses=(TaskStatus.FAILED,), error_code="RARE_CODE"),
    TaskFilter(statuses=(TaskStatus.FAILED, TaskStatus.CANCELLED), queue="rare"),
    TaskFilter(statuses=(TaskStatus.CLAIMED, TaskStatus.RUNNING)),
    TaskFilter(statuses=(TaskStatus.COMPLETED, TaskStatus.PENDING), name="mail", queue="rare"),
]


@pytest.mark.parametrize("where", FILTERS, ids=repr)
def test_pages_with_a_scan_bound_show_every_match_once_newest_first(history: Conn, where: TaskFilter) -> None:
    expected = matching(history, where)
    assert expected, "the filter matches something"
    seen: list[uuid.UUID] = []
    before: uuid.UUID | None = None
    stopped = 0
    for _ in range(1000):
        page = browse_tasks(history, where, before=before, limit=50, scan=600)
        assert len(page.tasks) <= 50
        seen += [t.id for t in page.tasks]
        if page.searched_to is not None:
            stopped += 1
            assert page.next is not None and page.searched_to == browse.id_time(page.next)
        if page.next is None:
            break
        assert all(t.id >= page.next for t in page.tasks)
        before = page.next
    assert seen == expected
    if where.queue == "rare" and not where.statuses:
        # 1 row in 150, read through the primary key: pages stop at their bound
        assert stopped > 0


def test_a_page_within_a_time_range(history: Conn) -> None:
    row = history.execute("SELECT sent_at FROM tether_tasks ORDER BY id OFFSET 3000 LIMIT 1").fetchone()
    assert row is not None
    where = TaskFilter(queue="b", since=row["sent_at"], until=row["sent_at"] + timedelta(hours=1))
    expected = matching(history, where)
    assert 0 < len(expected) < 3600
    page = browse_tasks(history, where, before=None, limit=2000, scan=100_000)
    assert [t.id for t in page.tasks] == expected and page.next is None and page.searched_to is None


def index_uses(plan: Any) -> list[tuple[str, str]]:
    """Every (index, its condition) an EXPLAIN (FORMAT JSON) plan reads."""
    found = []
    if isinstance(plan, dict):
        if "Index Name" in plan:
            found.append((plan["Index Name"], plan.get("Index Cond", "")))
        for value in plan.values():
            found += index_uses(value)
    elif isinstance(plan, list):
        for value in plan:
            found += index_uses(value)
    return found


def test_a_list_of_statuses_with_their_own_index_reads_it(history: Conn) -> None:
    """Only the index's rows count towards the bound: a rare status's page is complete."""
    for statuses, code, index in [
        ((TaskStatus.FAILED,), "RARE_CODE", "tether_tasks_failed_code_idx"),
        ((TaskStatus.CANCELLED,), None, "tether_tasks_unsuccessful_idx"),
        ((TaskStatus.FAILED, TaskStatus.CANCELLED), None, "tether_tasks_unsuccessful_idx"),
        ((TaskStatus.CLAIMED, TaskStatus.RUNNING), None, "tether_tasks_in_flight"),  # either of two
    ]:
        where = TaskFilter(statuses=statuses, error_code=code)
        params = page_params(where, before=None, limit=50, scan=1000)
        [row] = history.execute(
            "EXPLAIN (FORMAT JSON) " + q("browse_tasks_indexed"), params, prepare=False
        ).fetchall()
        used = index_uses(row["QUERY PLAN"])
        assert any(name.startswith(index) for name, _ in used), (statuses, code, used)
        # The primary key only reads the page's rows, one id at a time: it is not the scan.
        assert all("(id = " in cond for name, cond in used if name == "tether_tasks_pkey"), used
    # About 500 FAILED rows among 12,000: all within one bound of 1,000, so the page is whole.
    failed = sum(n for (_, status), n in actual_counts(history).items() if status == "FAILED")
    assert 0 < failed < 1000
    page = browse_tasks(
        history, TaskFilter(statuses=(TaskStatus.FAILED,)), before=None, limit=1000, scan=1000
    )
    assert page.searched_to is None and Counter(t.status for t in page.tasks) == {TaskStatus.FAILED: failed}


def test_the_tasks_command_says_how_far_it_searched_and_goes_on(
    history: Conn, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(browse, "SCAN", 1000)
    expected = matching(history, TaskFilter(queue="rare"))
    runner = CliRunner()
    found: list[str] = []
    before: list[str] = []
    for _ in range(30):
        done = runner.invoke(
            tether.cli.cli, ["tasks", "--queue", "rare", "--json", *before, "--database-url", database_url]
        )
        assert done.exit_code == 0, done.output
        found += [t["id"] for t in json.loads(done.stdout)]
        if "older ones are not searched yet" not in done.stderr:
            break
        assert "(one call reads at most 1,000 tasks)" in done.stderr
        before = ["--before", done.stderr.rsplit("--before ", 1)[1].strip()]
    assert found == [str(i) for i in expected]
    refused = runner.invoke(tether.cli.cli, ["tasks", "--before", "nope", "--database-url", database_url])
    assert refused.exit_code == 2 and "--before" in refused.output


def test_the_dashboards_task_list_says_how_far_it_searched(
    history: Conn, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(browse, "SCAN", 1000)
    broker = PostgresBroker(PostgresConfig(database_url=database_url))
    server = serve(broker)
    try:
        # 1 task in 150 is in queue rare: the 1,000 rows a page reads hold about 7.
        status, _, body = get(server.url + "api/tasks?queue=rare&limit=20")
        assert status == 200
        page = json.loads(body)
        assert page["searched_to"] is not None and page["next"] is not None and page["scan"] == 1000
        assert 0 < len(page["tasks"]) < 20 and {t["queue"] for t in page["tasks"]} == {"rare"}
        status, _, body = get(server.url + "api/tasks?limit=5")
        page = json.loads(body)
        assert page["searched_to"] is None and len(page["tasks"]) == 5
    finally:
        server.shutdown()
        server.server_close()
        broker.close()


def test_one_queues_waiting_tasks_come_whole_from_the_claim_index_when_few(
    history: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queue with few PENDING tasks among many newer rows of other queues: listed whole
    from the claim index, not searched for through the primary key; with more waiting than
    browse.WAITING_LISTED, through the primary key, pages bounded, every match once."""
    rare = TaskFilter(statuses=(TaskStatus.PENDING,), queue="rare")
    expected = matching(history, rare)
    assert 0 < len(expected) < 50
    page = browse_tasks(history, rare, before=None, limit=50, scan=10)  # the scan bound does not apply
    assert [t.id for t in page.tasks] == expected and page.next is None and page.searched_to is None
    params = page_params(rare, before=None, limit=50, scan=10)
    [row] = history.execute(
        "EXPLAIN (FORMAT JSON) " + q("browse_tasks_waiting"), params, prepare=False
    ).fetchall()
    used = index_uses(row["QUERY PLAN"])
    assert "tether_tasks_claim_idx" in {name for name, _ in used}, used
    assert all("(id = " in cond for name, cond in used if name == "tether_tasks_pkey"), used

    monkeypatch.setattr(browse, "WAITING_LISTED", 100)  # queue a has about 1,100 waiting
    many = TaskFilter(statuses=(TaskStatus.PENDING,), queue="a")
    expected = matching(history, many)
    assert len(expected) > 100
    seen: list[uuid.UUID] = []
    before: uuid.UUID | None = None
    while True:
        page = browse_tasks(history, many, before=before, limit=300, scan=400)
        seen += [t.id for t in page.tasks]
        if page.next is None:
            break
        before = page.next
    assert seen == expected
