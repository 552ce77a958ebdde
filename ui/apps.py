"""App configuration of the browser UI: connects the audit-row notice (``ui.signals``) at start."""
from django.apps import AppConfig
from django.db.models.signals import post_save

from .signals import announce_audit_row


class UiConfig(AppConfig):
    """``ui``: views, templates, static files and the status stream of the management UI."""

    name = "ui"
    verbose_name = "browser UI"

    def ready(self) -> None:
        # A lazy sender ("app.Model"): this module imports no model while the app registry loads.
        post_save.connect(announce_audit_row, sender="registry.LifecycleEvent", dispatch_uid="ui-announce-audit-row")
