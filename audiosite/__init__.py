"""audiosite: an audio-model server (Django project package).

Importing the package makes the Celery app available as ``audiosite.celery_app``
so ``celery -A audiosite worker`` finds it.
"""
from .celery import app as celery_app

__all__ = ["celery_app"]
