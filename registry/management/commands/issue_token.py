"""``python manage.py issue_token USER``: an API token for the management routes.

Creates the user if needed (no password: token only), grants it the
``registry.manage_models`` permission and prints its DRF token (the same
token on every call; ``--rotate`` replaces it).
"""
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core.management import call_command
from django.core.management.base import BaseCommand
from rest_framework.authtoken.models import Token


class Command(BaseCommand):
    help = "Create (or reuse) a user with registry.manage_models and print its API token."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--rotate", action="store_true", help="replace the user's existing token")

    def handle(self, *args, **options):
        call_command("migrate", interactive=False, verbosity=0)  # works before the first `serve`, too
        user_model = get_user_model()
        user, created = user_model.objects.get_or_create(username=options["username"])
        if created:
            user.set_unusable_password()
            user.save()
        user.user_permissions.add(Permission.objects.get(content_type__app_label="registry", codename="manage_models"))
        if options["rotate"]:
            Token.objects.filter(user=user).delete()
        token, _ = Token.objects.get_or_create(user=user)
        self.stderr.write(f"{'created' if created else 'updated'} user {user.username!r} with registry.manage_models")
        self.stdout.write(token.key)
