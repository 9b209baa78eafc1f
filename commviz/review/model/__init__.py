"""review's model: the dataclasses an analysis returns that more than one module tells
(``verdict``: the judge makes it; the report, the launch, ``status`` and ``serve`` word it)."""
