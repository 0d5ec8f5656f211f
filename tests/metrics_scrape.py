"""Scraping a /metrics endpoint in the tests: the samples by name and labels."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str, headers: dict[str, str] | None = None) -> Samples:
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of every sample of ``name`` whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)
