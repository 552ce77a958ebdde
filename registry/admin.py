"""Django admin: registrations and the lifecycle log, read-only where the runtime owns the truth."""
from django.contrib import admin

from .models import LifecycleEvent, ModelRegistration


@admin.register(ModelRegistration)
class ModelRegistrationAdmin(admin.ModelAdmin):
    list_display = ("model_id", "family", "task", "mode", "state", "source", "busy_timeout_ms", "updated_at")
    list_filter = ("family", "task", "state", "source")
    search_fields = ("model_id", "family")
    readonly_fields = ("state", "last_error", "created_at", "updated_at", "loaded_at", "source")

    # Registrations change only through registry.services (config sync now,
    # management routes later), never by editing rows here.
    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(LifecycleEvent)
class LifecycleEventAdmin(admin.ModelAdmin):
    list_display = ("created_at", "model_id", "event", "outcome", "actor", "duration_ms")
    list_filter = ("event", "outcome")
    search_fields = ("model_id", "detail")

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
