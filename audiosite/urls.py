"""Routes of audiosite (see ../shared/spec/API.md)."""
from django.contrib import admin
from django.urls import include, path

from inference import apis as inference_apis
from inference.audio_models_api import AudioModelsApi
from registry import apis as registry_apis
from ui import views as ui_views

urlpatterns = [
    path("", ui_views.root),
    path("ui/", include("ui.urls")),
    path("health", registry_apis.HealthApi.as_view()),
    path("metrics", registry_apis.MetricsApi.as_view()),
    path("v1/models", registry_apis.ModelListApi.as_view()),
    path("v1/models/load", registry_apis.ModelLoadApi.as_view()),
    path("v1/models/unload", registry_apis.ModelUnloadApi.as_view()),
    path("v1/models/<str:model_id>", registry_apis.ModelDetailApi.as_view()),
    path("v1/tasks/unload_models", registry_apis.UnloadModelsApi.as_view()),
    path("v1/tasks/unload_all_models", registry_apis.UnloadAllModelsApi.as_view()),
    path("v1/audio/transcriptions", inference_apis.TranscriptionApi.as_view()),
    path("v1/audio/transcriptions/details", inference_apis.TranscriptionDetailsApi.as_view()),
    path("v1/audio/speech", inference_apis.SpeechApi.as_view()),
    path("v1/audio/voices", inference_apis.VoicesApi.as_view()),
    path("v1/audio/models", AudioModelsApi.as_view()),
    path("v1/tasks/run", inference_apis.TaskRunApi.as_view()),
    path("admin/", admin.site.urls),
]

handler400 = "audiosite.errors.bad_request_view"
handler404 = "audiosite.errors.not_found_view"
handler500 = "audiosite.errors.server_error_view"
