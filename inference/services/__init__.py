"""Decisions about inference: run a request, make sure a model is loaded, make room, evict, retire, tear down.

Views and Celery tasks call these (``from inference import services``, then ``services.request_run(...)``);
they use the mechanism of ``inference.runtime`` and record lifecycle steps through
``registry.records`` (the only writer of the database). One module per concern:

=====================  ==================================================================================
concern                module (its public names, re-exported here)
=====================  ==================================================================================
audio input            ``audio_input``: :class:`AudioInput`, :func:`audio_inspect`,
                       :func:`audio_inspect_and_decode`, :func:`audio_decode` (and
                       ``decoded_bytes_needed``, which lives beside the budget in
                       ``inference.runtime.decoding``)
the one teardown path  ``teardown``: :func:`model_teardown`, :func:`model_retire_if_idle`
loading and residency  ``loading``: :func:`model_ensure_loaded`, :func:`models_preload` (:class:`PreloadResult`),
                       :func:`residency_make_room`, ``COUNTED_STATES``, ``ROOM_POLL_S``
one request            ``request``: :func:`request_probe`, :func:`request_model_resolve`, :func:`request_run`
                       (:class:`Outcome`), :func:`reply_error`
pipelines              ``pipelines``: :func:`diarization_run`, :func:`transcription_with_speakers_run`
streams                ``streams``: :func:`speech_open` (:class:`SpeechStream`), :func:`transcription_open`
                       (:class:`TranscriptionStream`)
live decode            ``live_decode``: :func:`live_turn_decode` (one decode of a live transcription turn)
=====================  ==================================================================================

Imports run one way inside the package: audio_input, teardown → loading → request → pipelines;
streams and live_decode use loading (and request's ``reply_error``).

Flow of one request (web process, async, no thread held while waiting):

0. read the upload's container header (no frame decoded): a bad header,
   too long, or a decode larger than the whole decode budget is refused
   (400/413/415) before any ticket exists;
1. acquire a request lease under the effective busy timeout (R3.1–R3.3);
   a refusal (fail-fast, timeout) costs no decoding;
2. reserve the decode's peak bytes in this process's decode budget (503
   ``decode_budget`` past it, the lease given back), then decode in a pool of
   its own (``inference.runtime.decoding``); audio that cannot be decoded is
   refused (400/415) and the lease given back;
3. make sure the model is loaded (single flight across processes, R4.2;
   with a residency limit, cold loads pass the cold-load guard and evict, R6);
4. store the input in Redis (TTL) and push the run's header on the owning
   worker's run queue (one round trip; ``inference.runtime.runs.run_on_worker``);
   the web process then drops the samples and gives back the reservation;
5. await the ``done:<id>`` wake-up; the worker releases the lease.

Decoding after the grant means a queued request holds only its upload, not
the decoded samples (a small compressed file can decode to far more); the
budget bounds what the granted ones hold at once.

The web process renews the lease until the worker reports back, and releases
it itself on every path where the worker never took over (refusal, load
failure, lost worker). If the client disconnects after dispatch, the running
step finishes on the worker, which releases the lease (R8.2).
"""
from __future__ import annotations

from inference.runtime.decoding import decoded_bytes_needed

from .audio_input import AudioInput, audio_decode, audio_inspect_and_decode, audio_inspect
from .live_decode import live_turn_decode
from .loading import (COUNTED_STATES, ROOM_POLL_S, PreloadResult, model_ensure_loaded, models_preload,
                      residency_make_room)
from .pipelines import diarization_run, transcription_with_speakers_run
from .request import Outcome, request_model_resolve, request_probe, reply_error, request_run
from .streams import SpeechStream, TranscriptionStream, speech_open, stream_lease_acquire, transcription_open
from .teardown import model_retire_if_idle, model_teardown

__all__ = [
    "AudioInput",
    "COUNTED_STATES",
    "Outcome",
    "PreloadResult",
    "ROOM_POLL_S",
    "SpeechStream",
    "TranscriptionStream",
    "audio_decode",
    "audio_inspect",
    "audio_inspect_and_decode",
    "decoded_bytes_needed",
    "diarization_run",
    "live_turn_decode",
    "model_ensure_loaded",
    "model_retire_if_idle",
    "model_teardown",
    "models_preload",
    "reply_error",
    "request_model_resolve",
    "request_probe",
    "request_run",
    "residency_make_room",
    "speech_open",
    "stream_lease_acquire",
    "transcription_open",
    "transcription_with_speakers_run",
]
