"""Who may manage models: one rule for the HTTP routes and the Django admin (API.md gate).

Management needs ``ui_management`` on (config key or ``serve --ui-management``)
and a caller holding the ``registry.manage_models`` permission.
"""
from audiosite.serverconfig import get_config

MANAGEMENT_DISABLED = ("management is disabled: start the server with --ui-management "
                       "(or \"ui_management\": true in server.json)")


def management_enabled() -> bool:
    """True when this deployment turned the management routes on."""
    return get_config().ui_management


def may_manage(user) -> bool:
    """True when ``user`` holds ``registry.manage_models`` (``has_perm``: superusers always do)."""
    return user is not None and user.is_authenticated and user.has_perm("registry.manage_models")
