"""Django admin: registrations, the lifecycle log (read-only) and API tokens (listed, revocable, never shown).

Rows are never edited directly: the admin's actions (load, unload) and its
reconfigure page call the same ``registry.services`` transitions as the
management routes, under the same gate (``ui_management`` on and the
``registry.manage_models`` permission). They run outside any admin
transaction, because a transition waits for older requests and for the
worker, which writes the same rows.
"""
import json

from asgiref.sync import async_to_sync
from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.shortcuts import get_object_or_404, redirect
from django.template.response import TemplateResponse
from django.urls import path, reverse

from audiosite.errors import ApplicationError
from audiosite.input_checks import MAX_JSON_DEPTH, bad_text_path, json_depth_exceeds
from inference.runtime.context import async_context

from . import services
from .models import ApiToken, LifecycleEvent, ModelRegistration
from .selectors import registration_body_of
from .permissions import MANAGEMENT_DISABLED, management_enabled, may_manage


def _check_gate(request) -> None:
    if not management_enabled():
        raise PermissionDenied(MANAGEMENT_DISABLED)
    if not may_manage(request.user):
        raise PermissionDenied("you lack the registry.manage_models permission")


class ReconfigureForm(forms.Form):
    """The complete ``POST /v1/models/load`` body of one model (omitted keys take their defaults).

    The JSON is parsed here (not by ``forms.JSONField``) so that absurd input
    (deep nesting, unpaired surrogates) is a form error, never a 500.
    """

    entry = forms.CharField(widget=forms.Textarea(attrs={"rows": 16, "cols": 90}), max_length=1_000_000,
                            help_text="The model's complete entry as JSON; the id cannot change here.")

    def clean_entry(self) -> dict:
        try:
            value = json.loads(self.cleaned_data["entry"])
        except (ValueError, RecursionError) as exc:
            raise forms.ValidationError(f"not valid JSON: {type(exc).__name__}") from None
        if json_depth_exceeds(value):
            raise forms.ValidationError(f"nested more than {MAX_JSON_DEPTH} levels deep")
        if not isinstance(value, dict):
            raise forms.ValidationError("a JSON object is expected")
        if bad_text_path(value) is not None:
            raise forms.ValidationError("text may not contain NUL characters or unpaired UTF-16 surrogates")
        return value


@admin.register(ModelRegistration)
class ModelRegistrationAdmin(admin.ModelAdmin):
    list_display = ("model_id", "family", "task", "mode", "slots", "state", "source", "busy_timeout_ms", "updated_at")
    list_filter = ("family", "task", "state", "source")
    search_fields = ("model_id", "family")
    readonly_fields = ("state", "last_error", "created_at", "updated_at", "loaded_at", "source")
    actions = ["load_selected", "unload_selected"]
    change_form_template = "admin/registry/modelregistration/change_form.html"

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def get_actions(self, request):
        actions = super().get_actions(request)
        if not (management_enabled() and may_manage(request.user)):
            actions.pop("load_selected", None)
            actions.pop("unload_selected", None)
        return actions

    def render_change_form(self, request, context, *args, **kwargs):
        context["can_manage"] = management_enabled() and may_manage(request.user)
        return super().render_change_form(request, context, *args, **kwargs)

    def get_urls(self):
        own = [path("<int:object_id>/reconfigure/", self.admin_site.admin_view(self.reconfigure_view),
                    name="registry_modelregistration_reconfigure")]
        return own + super().get_urls()

    @admin.action(description="Load selected models (through the management services)")
    def load_selected(self, request, queryset):
        _check_gate(request)
        for row in queryset:
            body = {"id": row.model_id}  # a plain load: the registration as it is
            try:
                outcome = async_to_sync(self._load)(body, request.user.get_username())
                self.message_user(request, f"{row.model_id}: loaded={outcome['loaded']}")
            except ApplicationError as exc:
                self.message_user(request, f"{row.model_id}: {exc.message}", messages.ERROR)

    @admin.action(description="Unload selected models (bulk unload)")
    def unload_selected(self, request, queryset):
        _check_gate(request)
        ids = [row.model_id for row in queryset]
        outcome = async_to_sync(self._bulk_unload)(ids, request.user.get_username())
        self.message_user(request, "unloaded: " + (", ".join(outcome["unloaded"]) or "nothing") +
                          ("; skipped (first load still running): " + ", ".join(outcome["skipped"])
                           if outcome["skipped"] else ""))

    def reconfigure_view(self, request, object_id):
        """GET: the current entry as JSON; POST: reconfigure through the service (R4.4)."""
        _check_gate(request)
        row = get_object_or_404(ModelRegistration, pk=object_id)
        if request.method == "POST":
            form = ReconfigureForm(request.POST)
            if form.is_valid():
                body = form.cleaned_data["entry"]
                if body.get("id") != row.model_id:
                    form.add_error("entry", f"a JSON object whose id is {row.model_id!r}")
                else:
                    try:
                        outcome = async_to_sync(self._load)(body, request.user.get_username())
                        self.message_user(request, f"{row.model_id}: reconfigured={outcome['reconfigured']}, "
                                                   f"loaded={outcome['loaded']}")
                        return redirect(reverse("admin:registry_modelregistration_change", args=[row.pk]))
                    except ApplicationError as exc:
                        if getattr(exc, "committed", False):  # the new entry is in place; its load failed
                            self.message_user(request, f"{row.model_id}: the new entry is saved, but loading it "
                                                       f"failed: {exc.message}", messages.WARNING)
                            return redirect(reverse("admin:registry_modelregistration_change", args=[row.pk]))
                        form.add_error("entry", exc.message)
        else:
            form = ReconfigureForm(initial={"entry": json.dumps(_body_of(row), indent=2)})
        context = {**self.admin_site.each_context(request), "opts": self.model._meta, "original": row,
                   "form": form, "title": f"Reconfigure {row.model_id}"}
        return TemplateResponse(request, "admin/registry/modelregistration/reconfigure.html", context)

    @staticmethod
    async def _load(body: dict, actor: str) -> dict:
        return await services.model_register_or_reconfigure(await async_context(), body, actor)

    @staticmethod
    async def _bulk_unload(ids: list[str], actor: str) -> dict:
        return await services.models_bulk_unload(await async_context(), ids, actor)


def _body_of(row: ModelRegistration) -> dict:
    """The management body that re-registers ``row`` as it is (every key, voice presets included)."""
    return registration_body_of(row.as_meta())


@admin.register(LifecycleEvent)
class LifecycleEventAdmin(admin.ModelAdmin):
    """The audit log, view only: no one (superusers included) adds, changes or deletes a row here."""

    list_display = ("created_at", "model_id", "event", "outcome", "actor", "duration_ms")
    list_filter = ("event", "outcome")
    search_fields = ("model_id", "detail")

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """API tokens: who holds one and since when; a token may be deleted (revoked).

    Neither the token (never stored) nor its digest is shown; tokens are issued
    by ``manage.py issue_token`` only, so there is no add or change page.
    """

    list_display = ("user", "created_at")
    fields = ("user", "created_at")
    readonly_fields = ("user", "created_at")
    search_fields = ("user__username",)

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
