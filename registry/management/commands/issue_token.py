"""``python manage.py issue_token USER``: an API token for the management routes.

Creates the user if needed (no password: token only), grants it the
``registry.manage_models`` permission, issues a new token and prints it on
stdout. The token is shown this once: the database keeps only its SHA-256
(``registry.models.ApiToken``). The user's earlier tokens stay valid;
``--rotate`` revokes them.
"""
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core.management import call_command
from django.core.management.base import BaseCommand

from registry.records import api_token_issue


class Command(BaseCommand):
    help = "Create (or reuse) a user with registry.manage_models, issue a new API token and print it (once)."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--rotate", action="store_true", help="revoke the user's earlier tokens")

    def handle(self, *args, **options):
        call_command("migrate", interactive=False, verbosity=0)  # works before the first `serve`, too
        user_model = get_user_model()
        user, created = user_model.objects.get_or_create(username=options["username"])
        if created:
            user.set_unusable_password()
            user.save()
        user.user_permissions.add(Permission.objects.get(content_type__app_label="registry", codename="manage_models"))
        token = api_token_issue(user, revoke_others=options["rotate"])
        self.stderr.write(f"{'created' if created else 'updated'} user {user.username!r} with registry.manage_models; "
                          "the token below is shown only once (only its hash is stored)")
        self.stdout.write(token)
