from django.apps import AppConfig


class InferenceConfig(AppConfig):
    """Scheduler, runtimes, adapters, worker pools and the inference API."""

    name = "inference"
    default_auto_field = "django.db.models.BigAutoField"
