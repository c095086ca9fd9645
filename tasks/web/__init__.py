"""What the package serves over HTTP: the dashboard pages, the JSON API (``api/``), the queries
behind both (``queries.py`` and ``listings.py``, one bounded statement per page) and the Prometheus
metrics."""
