"""Reading a Prometheus exposition in tests: always through ``prometheus_client``'s parser,
so a test that reads ``/metrics`` also proves the text is a valid exposition."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


class Exposition:
    """The families and samples of one exposition; a malformed text raises ``ValueError``."""

    def __init__(self, text: str) -> None:
        self.types: dict[str, str] = {}
        self.values: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in text_string_to_metric_families(text):
            assert family.name not in self.types, f"family {family.name} exposed twice"
            self.types[family.name] = family.type
            for sample in family.samples:
                key = (sample.name, frozenset(sample.labels.items()))
                assert key not in self.values, f"sample {key} exposed twice"
                self.values[key] = sample.value

    def __call__(self, sample: str, /, **labels: str) -> float:
        """The value of the sample named ``sample`` with exactly ``labels``."""
        return self.values[(sample, frozenset(labels.items()))]

    def series(self, name: str) -> dict[frozenset[tuple[str, str]], float]:
        """Every sample named ``name``, by its labels."""
        return {labels: v for (n, labels), v in self.values.items() if n == name}
