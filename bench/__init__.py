"""The benchmarks: the ``manage.py bench_*`` commands (``docs/benchmarks.md``) and the two reference
servers of ``bench_latency`` (:mod:`bench.reference`).

A tool, not the product: the commands start their own servers (``gate.servers.Server``) or measure a
running one over HTTP, and print reports. Nothing on the request path imports this package
(``tests/test_layout.py``).
"""
