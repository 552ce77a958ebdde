from django.apps import AppConfig


class RegistryConfig(AppConfig):
    """Model registrations and their lifecycle audit log."""

    name = "registry"
    default_auto_field = "django.db.models.BigAutoField"
