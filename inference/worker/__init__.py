"""The GPU worker (a Celery process, ``--pool threads``): its pools, liveness, idle retirement and tasks.

Only worker processes import this package (Celery finds ``tasks`` here); the
web process sends tasks by name and never imports it.
"""
