from django.apps import AppConfig


class GateConfig(AppConfig):
    """The validation gate: ``manage.py validate_slots``, ``validate_framework`` and ``admission``."""

    name = "gate"
