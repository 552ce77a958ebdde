"""The Celery application of audiosite.

GPU workers run ``celery -A audiosite worker -Q gpu --pool threads``. With
``worker_direct`` on, every worker also consumes its own direct queue, so an
unload task can be sent to the worker that owns a model's loaded pool. Runs
do not travel as Celery tasks (see ``inference.worker.runs``).
"""
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "audiosite.settings")

app = Celery("audiosite")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["inference.worker"])
