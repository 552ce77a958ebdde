from django.apps import AppConfig


class BenchConfig(AppConfig):
    """The benchmarks: the ``manage.py bench_*`` commands."""

    name = "bench"
