"""Side by side with peers: tether, pgqueuer and procrastinate on the same scenarios
(``python -m bench.peers``; bench/README.md "Side by side with peers"). pgqueuer and
procrastinate are the ``bench-peers`` extra; only this package imports them."""
