"""Routes of the browser UI, mounted at ``/ui/`` by ``audiosite.urls`` (the WebSocket is in ``ui.routing``)."""
from django.contrib.auth import views as auth_views
from django.urls import path

from . import views

app_name = "ui"

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("models/<str:model_id>", views.model_detail, name="model"),
    path("models/<str:model_id>/minutes", views.model_minutes, name="model_minutes"),
    path("log", views.lifecycle_log, name="log"),
    path("activity", views.activity, name="activity"),
    path("playground", views.playground, name="playground"),
    path("sample.wav", views.sample, name="sample"),
    path("sample-other.wav", views.sample_other, name="sample_other"),
    path("login/", views.UiLoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("manage/register", views.register, name="register"),
    path("manage/unload", views.bulk_unload, name="bulk_unload"),
    path("manage/<str:model_id>/slots", views.resize, name="resize"),
    path("manage/<str:model_id>/load", views.load, name="load"),
    path("manage/<str:model_id>/configure", views.configure, name="configure"),
    path("manage/<str:model_id>/unload", views.unload, name="unload"),
    path("manage/<str:model_id>/unregister", views.unregister, name="unregister"),
]
