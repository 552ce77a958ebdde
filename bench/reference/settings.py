"""Settings of the minimal adrf reference: no middleware, no authentication, no database."""
SECRET_KEY = "bench-reference-only"  # serves one constant JSON route on loopback
DEBUG = False
ALLOWED_HOSTS = ["*"]
INSTALLED_APPS = ["rest_framework"]
MIDDLEWARE: list[str] = []
ROOT_URLCONF = "bench.reference.urls"
DATABASES: dict = {}
USE_TZ = True
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [],
    "DEFAULT_PERMISSION_CLASSES": [],
    "UNAUTHENTICATED_USER": None,
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
}
