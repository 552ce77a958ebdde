"""server.json parsing and start-up refusals (R1.2 on the legacy runtime)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from audiosite.serverconfig import ConfigError, DEFAULT_CONFIG_PATH, load_config, parse_config

from .support.processes import ROOT


def problems_of(data) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value.problems


def test_shipped_default_config_is_valid():
    config = load_config(DEFAULT_CONFIG_PATH, overrides={})
    assert {m.family for m in config.models} == {"whisper", "silero_vad", "piper", "speaker_embedding", "basic_pitch",
                                                 "diarization"}
    assert all(m.lazy for m in config.models if m.family in ("speaker_embedding", "basic_pitch", "diarization")), \
        "the catalogue families load on first use: start-up stays as fast as with the three eager models"
    assert config.busy_timeout_ms == 300000 and config.lease_ttl_ms == 30000 and config.port == 8080
    piper = next(m for m in config.models if m.family == "piper")
    openai_voices = {"alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer"}
    assert openai_voices <= set(piper.voice_presets)
    assert {p.voice for p in piper.voice_presets.values()} == {"joe"}


def test_voice_presets_are_checked_against_the_family():
    good = {"id": "tts", "family": "piper", "voice_presets": {"alloy": {"voice": "joe", "options": {"speed": 1.5}}},
            "default_voice_preset": "alloy"}
    assert parse_config({"models": [good]}).models[0].voice_presets["alloy"].options == {"speed": 1.5}
    problems = [
        ({**good, "voice_presets": {"alloy": {"voice": "joe", "options": {"speed": 9}}}},
         "voice_presets.alloy.options.speed"),
        ({**good, "voice_presets": {"alloy": {"voice": "joe", "options": {"pitch": 1}}}},
         "voice_presets.alloy.options"),
        ({**good, "default_voice_preset": "nova"}, "default_voice_preset"),
        ({**good, "voice_presets": {"alloy": {"options": {}}}}, "voice"),
        ({"id": "w", "family": "whisper", "voice_presets": {"alloy": {"voice": "joe"}}}, "voice_presets"),
    ]
    for entry, key in problems:
        with pytest.raises(ConfigError) as refused:
            parse_config({"models": [entry]})
        assert key in str(refused.value), (key, str(refused.value))


def test_defaults_follow_api_md():
    config = parse_config({"models": [], "ui_management": True})
    assert (config.host, config.backend, config.threads, config.lazy_load) == ("127.0.0.1", "auto", 1, False)
    assert config.max_request_body_bytes == 104857600 and config.shutdown_timeout_ms == 30000
    assert (config.max_loaded_models, config.idle_unload_ms, config.min_free_memory_mb) == (0, 0, 0)
    assert (config.eviction_policy, config.use_half_life_ms, config.min_residency_ms) == ("recent_use", 10000, 2000)
    assert not config.residency_limited


def test_an_empty_model_list_needs_ui_management():
    """API.md: ``models`` may be empty only with ``ui_management`` (models then come from the API)."""
    found = problems_of({"models": []})
    assert found == ["key 'models': the list may be empty only with ui_management on (models are then "
                     "registered through POST /v1/models/load)"]


@pytest.mark.parametrize("key, value", [("max_loaded_models", -1), ("idle_unload_ms", "1000"),
                                        ("min_free_memory_mb", 1.5), ("ui_management", "yes"),
                                        ("eviction_policy", "mru"), ("use_half_life_ms", 10),
                                        ("min_residency_ms", -1)])
def test_residency_and_management_keys_are_typed(key, value):
    """R6: residency limits are non-negative integers, the eviction policy one of its names (a half-life of
    at least 100 ms); ui_management is a boolean."""
    found = problems_of({key: value, "ui_management": True, "models": []} if key != "ui_management"
                        else {key: value, "models": [{"id": "v", "family": "silero_vad"}]})
    assert any(p.startswith(f"key '{key}'") for p in found), found


def test_worker_restart_backoff_keys():
    """serve's restart backoff: 1 s doubling to 30 s by default; integers of at least 100 ms;
    a ceiling below the first delay is refused naming both keys."""
    config = parse_config({"models": [], "ui_management": True})
    assert (config.worker_restart_delay_ms, config.worker_restart_max_delay_ms) == (1000, 30000)
    base = {"models": [], "ui_management": True}
    assert any(p.startswith("key 'worker_restart_delay_ms'")
               for p in problems_of({**base, "worker_restart_delay_ms": 50}))
    assert any(p.startswith("key 'worker_restart_max_delay_ms'")
               for p in problems_of({**base, "worker_restart_max_delay_ms": "30000"}))
    assert problems_of({**base, "worker_restart_delay_ms": 60000}) == [
        "key 'worker_restart_max_delay_ms': 30000 is below worker_restart_delay_ms=60000"]


@pytest.mark.parametrize("slots", [1, None, 2, 0, "2"])
def test_explicit_slots_is_refused_on_legacy_runtime(slots):
    """R1.2: any explicit slots key, including 1 and null, is a start-up error naming the model."""
    found = problems_of({"models": [{"id": "asr", "family": "whisper", "slots": slots}]})
    assert len(found) == 1
    assert "models[0] (id 'asr')" in found[0] and "'slots'" in found[0] and "--parallel-jobs" in found[0]


def test_unknown_keys_are_named_with_their_model():
    found = problems_of({"colour": "blue", "models": [{"id": "vad", "family": "silero_vad", "treshold": 1}]})
    assert "key 'colour': unknown key" in found
    assert "models[0] (id 'vad'): key 'treshold': unknown key" in found


def test_duplicate_ids_are_refused():
    found = problems_of({"models": [{"id": "a", "family": "silero_vad"}, {"id": "a", "family": "whisper"}]})
    assert found == ["models[1] (id 'a'): duplicate model id 'a'"]


@pytest.mark.parametrize(
    "key, value",
    [("busy_timeout_ms", "100"), ("busy_timeout_ms", True), ("busy_timeout_ms", 1.5), ("busy_timeout_ms", -1),
     ("lazy", "yes"), ("family", 3)],
)
def test_wrong_model_types_are_refused(key, value):
    entry = {"id": "m", "family": "silero_vad", key: value}
    found = problems_of({"models": [entry]})
    assert any(f"(id 'm'): key '{key}'" in p for p in found), found


@pytest.mark.parametrize("key, value", [("port", "8080"), ("port", 0), ("backend", "tpu"), ("lazy_load", 1),
                                        ("lease_ttl_ms", 10), ("media_roots", "/tmp")])
def test_wrong_top_level_types_are_refused(key, value):
    found = problems_of({key: value, "models": [{"id": "v", "family": "silero_vad"}]})
    assert any(p.startswith(f"key '{key}'") for p in found), found


def test_family_task_mode_and_options_are_checked_against_the_spec():
    found = problems_of({"models": [
        {"id": "x", "family": "nope"},
        {"id": "y", "family": "whisper", "task": "vad"},
        {"id": "z", "family": "silero_vad", "mode": "streaming"},
        {"id": "w", "family": "whisper", "load_options": {"compute_type": "int3"}},
        {"id": "v", "family": "silero_vad", "default_request_options": {"threshold": 2}},
        {"id": "u", "family": "silero_vad", "path": "/no/such/file.onnx"},
        {"id": "t", "family": "speaker_embedding", "modes": ["offline", "streaming"]},
        {"id": "s", "family": "whisper", "modes": ["offline", "streaming"]},
        {"id": "r", "family": "whisper", "modes": ["offline", "offline"]},
        {"id": "q", "family": "whisper", "modes": ["streaming"]},
        {"id": "p", "family": "whisper", "mode": "streaming", "modes": ["streaming"]},
    ]})
    joined = "\n".join(found)
    assert "models[0] (id 'x'): key 'family': unknown family 'nope'" in joined
    assert "models[1] (id 'y'): key 'task'" in joined
    assert "models[2] (id 'z'): key 'mode'" in joined
    assert "models[3] (id 'w'): key 'load_options.compute_type'" in joined
    assert "models[4] (id 'v'): key 'default_request_options.threshold'" in joined
    assert "models[5] (id 'u'): key 'path'" in joined
    assert ("models[6] (id 't'): key 'modes': family 'speaker_embedding' serves modes ['offline'], "
            "not 'streaming'") in joined
    assert "(id 's')" not in joined  # whisper serves offline and streaming
    assert "models[8] (id 'r'): key 'modes': lists a mode more than once" in joined
    assert "models[9] (id 'q'): key 'mode': 'offline' is not among the registration's modes ['streaming']" in joined
    assert "(id 'p')" not in joined  # a streams-only registration names its mode


def test_keys_of_later_features_are_refused_not_ignored():
    found = problems_of({"cors_origins": "*", "models": [{"id": "v", "family": "silero_vad"}]})
    assert found == ["key 'cors_origins': CORS is not supported by this version of audiosite"]


def test_the_ui_keys_have_their_defaults_and_refuse_other_values():
    """``ui`` (default true) turns the browser UI off; ``ui_anonymous`` is "status" or "none"."""
    entry = [{"id": "v", "family": "silero_vad"}]
    config = parse_config({"models": entry})
    assert (config.ui, config.ui_anonymous) == (True, "status")
    config = parse_config({"models": entry, "ui": False, "ui_anonymous": "none"})
    assert (config.ui, config.ui_anonymous) == (False, "none")
    found = problems_of({"models": entry, "ui": "no", "ui_anonymous": "everything"})
    assert [p.split(":")[0] for p in found] == ["key 'ui'", "key 'ui_anonymous'"]


def test_invalid_json_file_names_the_line(tmp_path):
    path = tmp_path / "server.json"
    path.write_text('{"models": [\n  {"id": "a",}\n]}')
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides={})
    assert "invalid JSON at line 2" in info.value.problems[0]


def test_an_integer_beyond_pythons_digit_limit_is_a_config_error(tmp_path):
    """Json.loads raises a plain ValueError (not JSONDecodeError) for a 4301+ digit integer."""
    path = tmp_path / "server.json"
    path.write_text('{"busy_timeout_ms": ' + "9" * 5000 + ', "models": [{"id": "a", "family": "silero_vad"}]}')
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides={})
    assert info.value.problems[0].startswith("invalid JSON: Exceeds the limit (4300 digits)")


def test_serve_refuses_to_start_on_a_bad_config(tmp_path):
    """R1.2: the start-up error names the model and the key; nothing is started."""
    path = tmp_path / "server.json"
    path.write_text(json.dumps({"backend": "cpu", "models": [{"id": "vad", "family": "silero_vad", "slots": 1}]}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUDIOSITE_")}
    env["AUDIOSITE_VAR_DIR"] = str(tmp_path / "var")
    proc = subprocess.run([sys.executable, "manage.py", "serve", "--config", str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "models[0] (id 'vad'): key 'slots'" in proc.stderr
    assert "listening" not in proc.stdout


# -- the parallel runtime (--parallel-jobs) ---------------------------------------------------
def parallel(data, backend="cpu"):
    return parse_config(data, parallel=True, backend_resolver=lambda _configured: backend)


def parallel_problems(data, backend="cpu") -> list[str]:
    with pytest.raises(ConfigError) as info:
        parallel(data, backend)
    return info.value.problems


def test_parallel_runtime_accepts_slots_and_omitted_means_one():
    """R1.3: slots 1..N accepted; omitted slots = 1."""
    config = parallel({"models": [{"id": "w", "family": "whisper", "slots": 4},
                                  {"id": "v", "family": "silero_vad"}]})
    assert [m.slots for m in config.models] == [4, None]


@pytest.mark.parametrize("slots", [0, -1, 17, None, True, "2", 1.5])
def test_parallel_runtime_refuses_invalid_counts(slots):
    """R1.3: 0, -1, 17, null, true, "2", 1.5 are start-up errors naming the model."""
    found = parallel_problems({"models": [{"id": "v", "family": "silero_vad", "slots": slots}]})
    assert len(found) == 1 and found[0].startswith("models[0] (id 'v'): key 'slots': must be an integer from 1 to 16")


def test_count_above_advertised_capacity_names_the_capacity():
    """R9.1: 5 slots of whisper against capacity 4 → message contains capacity=4."""
    found = parallel_problems({"models": [{"id": "w", "family": "whisper", "slots": 5}]})
    assert "capacity=4" in found[0]


def test_only_counts_in_the_admission_table_are_served():
    """R9.2: nothing above 1 slot on CUDA (no validated counts), and 5..16 of silero_vad on CPU."""
    assert "not validated" in parallel_problems({"models": [{"id": "w", "family": "whisper", "slots": 2}]}, "cuda")[0]
    assert "admitted counts are 1..4" in parallel_problems(
        {"models": [{"id": "v", "family": "silero_vad", "slots": 8}]})[0]
    assert parallel({"models": [{"id": "w", "family": "whisper", "slots": 1}]}, "cuda").models[0].slots == 1


@pytest.mark.parametrize("validated, admitted", [([1, 2, 4], 2), ([1, 2, 3, 4], 4), ([2, 4], 1), ([], 1)])
def test_admitted_counts_need_every_smaller_count_validated(validated, admitted):
    """R9.2: only consecutively validated counts are admitted."""
    from inference import specs

    assert specs.consecutive_count(validated) == admitted


def test_fixture_family_exists_only_when_enabled(monkeypatch):
    """The controllable test family is never available by default."""
    monkeypatch.delenv("AUDIOSITE_ENABLE_FIXTURE_FAMILY", raising=False)
    assert "unknown family 'fixture'" in parallel_problems({"models": [{"id": "f", "family": "fixture"}]})[0]
    monkeypatch.setenv("AUDIOSITE_ENABLE_FIXTURE_FAMILY", "1")
    assert parallel({"models": [{"id": "f", "family": "fixture", "slots": 4}]}).models[0].family == "fixture"


def test_serve_with_parallel_jobs_refuses_a_bad_count(tmp_path):
    path = tmp_path / "server.json"
    path.write_text(json.dumps({"backend": "cpu", "models": [{"id": "vad", "family": "silero_vad", "slots": 17}]}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUDIOSITE_")}
    env["AUDIOSITE_VAR_DIR"] = str(tmp_path / "var")
    proc = subprocess.run([sys.executable, "manage.py", "serve", "--parallel-jobs", "--config", str(path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "models[0] (id 'vad'): key 'slots': must be an integer from 1 to 16" in proc.stderr


@pytest.mark.parametrize("host, extra, names", [
    ("127.0.0.1", [], ["127.0.0.1", "localhost", "[::1]"]),
    ("localhost", ["audio.example.com"], ["127.0.0.1", "localhost", "[::1]", "audio.example.com"]),
    ("::1", [], ["127.0.0.1", "localhost", "[::1]"]),
    ("127.0.0.2", [], ["127.0.0.1", "localhost", "[::1]", "127.0.0.2"]),
    ("0.0.0.0", [".example.com", "fe80::1"], ["127.0.0.1", "localhost", "[::1]", ".example.com", "[fe80::1]"]),
    ("192.168.1.4", [], ["192.168.1.4"]),
    ("audio.lan", ["10.0.0.2"], ["audio.lan", "10.0.0.2"]),
])
def test_allowed_host_names_are_the_bound_hosts_plus_allowed_hosts(host, extra, names):
    """Django's ALLOWED_HOSTS never defaults to '*': the bound host's names plus the allowed_hosts key."""
    config = parse_config({"host": host, "allowed_hosts": extra, "models": [{"id": "v", "family": "silero_vad"}]})
    assert config.allowed_host_names() == names


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_wildcard_bind_needs_allowed_hosts(host):
    found = problems_of({"host": host, "models": [{"id": "v", "family": "silero_vad"}]})
    assert len(found) == 1 and found[0].startswith("key 'allowed_hosts': host") and "every interface" in found[0]


@pytest.mark.parametrize("name", ["http://audio.example.com", "audio.example.com:8080", "a b", "/x", "", "-x"])
def test_allowed_hosts_entries_are_host_patterns(name):
    found = problems_of({"allowed_hosts": [name], "models": [{"id": "v", "family": "silero_vad"}]})
    assert found == [f"key 'allowed_hosts': {name!r} is not a host name, '.domain', IP address or '*' "
                     "(no scheme, port or path)"]
