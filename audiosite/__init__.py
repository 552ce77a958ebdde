"""audiosite: an audio-model server (Django project package).

Importing the package makes the Celery app available as ``audiosite.celery_app``
so ``celery -A audiosite worker`` finds it.

It also registers :func:`gc.freeze` to run at interpreter exit, in every process that imports
it (``serve``, the web processes, the workers, the management commands). Python's exit
collects the whole heap once more before the process ends; in a web process after serving or a
worker after its pools that collection took 0.8-1 s of CPU per process on a two-core machine
(``perf``: ``gc_collect_main``; docs/benchmarks.md, "Stopping"), for memory the OS frees anyway.
Frozen objects are left out of that collection; ``atexit`` handlers, thread joins and the
flushing of files still run as before.
"""
import atexit
import gc

from .celery import app as celery_app

atexit.register(gc.freeze)

__all__ = ["celery_app"]
