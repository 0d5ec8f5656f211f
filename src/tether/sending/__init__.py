"""Sending tasks: one plan per kind of send, and one place where plans run.

A send is checked and encoded into the plan of its kind before anything is written; the
plan knows its statement (sync and async) and the handles it answers with:

- ``one.OneSend``: one task (``send``, ``schedule`` and their async forms);
- ``one_unique.OneUniqueSend``: one task under a unique key (``with_options(unique_key=)``);
- ``many.ManySend``: a batch, all or none (``send_many``);
- ``many_unique.ManyUniqueSend``: a batch under unique keys (``send_many(unique_keys=)``).

``basis.SendBasis`` is what they share: the task, its send options and where it sends;
it turns a call's options into the row's columns (``row_spec``), the one place a send
option reaches the database. ``route.Route`` runs any plan on the app's pool or on the
connection the caller lent, from sync or async code. ``tether.task`` picks the plan.
"""
