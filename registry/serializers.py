"""Input serializers of the management routes (API.md "Management"): strict JSON bodies.

Every body is a JSON object of plain text (no NUL characters, no unpaired
surrogates, in keys or values) with only the keys its route takes. The deep
validation of a model entry (``POST /v1/models/load``) is the service's
(``registration_validate``); its serializer checks only the outer shape.
Errors name the field path (``audiosite.input_checks``).
"""
from __future__ import annotations

from collections.abc import Mapping

from audiosite.serverconfig import ModelConfig
from audiosite.input_checks import InputField, InputSerializer, TextField, bad_text_keys, nested_error

BAD_TEXT = "text in the body may not contain NUL characters or unpaired UTF-16 surrogates"


class ManagementBodySerializer(InputSerializer):
    """A management body: a JSON object of plain text with only the keys of :attr:`allowed`.

    Checked in this order: an object (``"the body must be a JSON object"``,
    ``param`` None); plain text (``BAD_TEXT``, ``param`` = the top-level key
    holding the bad string, None for a bad top-level key); no unknown key
    (``"unknown key(s) [...]; this route takes [...]"``, ``param`` = the
    first unknown key); then the declared fields.
    """

    body_message = "the body must be a JSON object"

    @property
    def allowed(self) -> tuple[str, ...]:
        """The keys this route takes (its declared fields)."""
        return tuple(self.fields)

    def to_internal_value(self, data):
        if isinstance(data, Mapping):
            found = bad_text_keys(data)
            if found:
                raise nested_error(found[0][:1], BAD_TEXT)
            unknown = sorted(set(data) - set(self.allowed))
            if unknown:
                raise nested_error((unknown[0],), f"unknown key(s) {unknown}; this route takes {list(self.allowed)}")
        return super().to_internal_value(data)


class ModelLoadInputSerializer(ManagementBodySerializer):
    """``POST /v1/models/load``: a model entry (the keys of ``ModelConfig``), passed on as sent.

    Validated data: the body itself (a dict); ``registration_validate`` checks its values.
    """

    @property
    def allowed(self) -> tuple[str, ...]:
        return tuple(ModelConfig.model_fields)

    def to_internal_value(self, data) -> dict:
        super().to_internal_value(data)
        return dict(data)


IDS_REQUIRED = "key '{name}': a list of model ids (strings) is required"
ID_REQUIRED = "key '{name}': a model id (string) is required"


class ModelIdsField(InputField):
    """A list of model ids (strings; may be empty)."""

    default_error_messages = {"required": IDS_REQUIRED, "type": IDS_REQUIRED}

    def to_internal_value(self, data) -> list[str]:
        if not isinstance(data, list) or not all(isinstance(i, str) for i in data):
            self.fail("type")
        return data


class ModelUnloadInputSerializer(ManagementBodySerializer):
    """``POST /v1/models/unload`` ``{"id": str}`` (non-empty)."""

    id = TextField(error_messages={"required": ID_REQUIRED, "type": ID_REQUIRED})


class UnloadModelsInputSerializer(ManagementBodySerializer):
    """``POST /v1/tasks/unload_models`` ``{"model_ids": [str, ...]}``."""

    model_ids = ModelIdsField()


class UnloadAllInputSerializer(ManagementBodySerializer):
    """``POST /v1/tasks/unload_all_models``: no keys (an empty body or ``{}``)."""

