"""The framework record of the validation gate: F1–F6 of ../shared/spec/VALIDATION.md, from named tests.

``FRAMEWORK_TESTS`` maps each of F1–F5 to pytest node ids of this repository's suite, each with a
one-line note of what it proves; ``run()`` runs them with pytest (JUnit XML kept beside the record),
and for F6 the whole suite plus a seeded stress run against a real server (``stress.py``), then
writes one ``kind="framework"`` evidence record (``evidence.py``).

How a check's status is decided (``check_status``):

- PASS: every mapped test ran and passed (a parametrized test mapped without its ``[…]`` part counts
  as all of its cases);
- FAIL: a mapped test failed or errored, or a mapped test was not found in the run (the map rotted:
  ``tests/test_validation_framework.py`` catches that before a run does);
- PENDING: nothing failed but a mapped test was skipped. A skip is not a pass: the check waits for a
  run where it executes (for example with ``AUDIOSITE_REQUIRE_SERVICES=1`` and Redis database 15,
  as ``scripts/test.sh`` sets up). F6 ignores only the skips named in ``EXPECTED_SKIPS``
  (parametrized cases that cannot apply by design, with the case that does run named).

F6 with ``quick=True`` is PENDING: only the mapped F1–F5 tests ran, not the whole suite nor the
stress run.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import TextIO

from django.conf import settings

from inference.backend import resolve_backend

from . import evidence
from .stress import run_stress

SCHED = "tests/test_scheduler.py::"
PAR = "tests/test_parallel.py::"
MGMT = "tests/test_management.py::"
RES = "tests/test_residency.py::"
HTTP = "tests/test_http.py::"
DRAIN = "tests/test_drain.py::"
OPS = "tests/test_operations.py::"
SVC = "tests/test_services.py::"
STREAM = "tests/test_streaming.py::"
SPEECH = "tests/test_speech.py::"
HARD = "tests/test_hardening.py::"
SERVE = "tests/test_serve.py::"
CONF = "tests/test_config.py::"
BUDGET = "tests/test_decode_budget.py::"
WMEM = "tests/test_worker_memory.py::"
# F-id -> [(pytest node id, what it proves)]. Node ids without "[...]" stand for every parametrized case.
FRAMEWORK_TESTS: dict[str, list[tuple[str, str]]] = {
    "F1": [
        (SCHED + "test_waiters_are_granted_in_fifo_order", "one FIFO per model, enqueue order"),
        (SCHED + "test_free_model_grants_at_once_and_release_is_idempotent",
         "leases are isolated tokens; a second release changes nothing"),
        (SCHED + "test_consecutive_requests_fill_spare_slots", "head-of-queue requests fill spare slots"),
        (SCHED + "test_manager_is_a_barrier_older_work_drains_first_and_later_work_neither_barges_nor_starves",
         "older request, then manager, then staggered later requests: older drains first, no barging, no starving"),
        (SCHED + "test_overlapping_managers_keep_enqueue_order", "overlapping managers keep enqueue order"),
        (SCHED + "test_cancelled_manager_barrier_lets_later_requests_use_spare_slots",
         "a cancelled manager barrier lets later requests use spare slots"),
        (SCHED + "test_overdue_holder_fails_fast", "fail-fast behind an overdue holder"),
        (SCHED + "test_overdue_fail_fast_with_a_waiting_manager_and_spare_slots",
         "overdue work with a waiting manager and spare slots fails fast"),
        (SCHED + "test_healthy_and_overdue_slots_allow_bounded_waiting",
         "healthy + overdue slots: bounded waiting is allowed"),
        (SCHED + "test_queue_timeout_fires_at_the_deadline_and_drops_the_ticket",
         "request timeout fires at the deadline, ticket dropped"),
        (SCHED + "test_timeout_zero_waits_without_bound_and_without_fail_fast",
         "timeout zero waits without bound and without fail-fast"),
        (SCHED + "test_manager_timeouts", "manager timeout and timeout zero"),
        (SCHED + "test_seeded_random_stress_keeps_every_invariant",
         "seeded scheduler stress equals a reference FIFO model; counters drain to zero"),
        (PAR + "test_sixteen_queued_requests_are_admitted_in_fifo_order",
         "end to end FIFO at 1, 2 and 4 slots, capacity one included"),
        (PAR + "test_request_timeouts_at_the_deadline_and_zero",
         "HTTP request timeout and timeout zero on the parallel path at capacity one"),
        (PAR + "test_manager_timeouts_and_zero", "HTTP manager timeout and timeout zero"),
        (PAR + "test_overdue_fail_fast_with_a_waiting_manager_and_a_spare_slot",
         "HTTP fail-fast with a waiting manager and a spare slot"),
        (CONF + "test_explicit_slots_is_refused_on_legacy_runtime",
         "legacy runtime refuses every explicit slots value (config file)"),
        (MGMT + "test_legacy_refuses_slots_and_manages_one_session_models",
         "legacy runtime refuses every explicit slots value (management API)"),
    ],
    "F2": [
        (PAR + "test_concurrent_cold_requests_publish_one_pool_and_all_wait_for_it",
         "concurrent first requests publish one complete pool"),
        (SCHED + "test_single_flight_load", "single-flight load at the scheduler"),
        (PAR + "test_unload_waits_for_a_load_in_progress_instead_of_skipping_it",
         "unload cannot skip a load in progress"),
        (PAR + "test_manager_barrier_older_drains_first_later_bind_the_new_pool",
         "requests bound before a barrier use the old pool, later ones the new"),
        (MGMT + "test_older_requests_drain_before_reconfigure_and_later_ones_bind_the_new_configuration",
         "reconfigure with queued work: older drain on the old configuration, later bind the new version"),
        (MGMT + "test_a_client_that_leaves_during_a_teardown_does_not_end_the_barrier",
         "forced unload/bulk/delete/reconfigure with queued work keep the barrier"),
        (MGMT + "test_invalid_reconfiguration_preserves_live_state",
         "invalid replacement keeps the working registration and pool"),
        (MGMT + "test_a_valid_resize_works_after_an_unsupported_one",
         "unsupported count -> 400 with the old count and pool kept; a valid resize then works"),
        (MGMT + "test_unsupported_count_on_a_new_registration_registers_it_unloaded",
         "unsupported count on a new id: registered, unloaded"),
        (MGMT + "test_failed_first_load_leaves_the_entry_registered_and_unloaded",
         "post-commit load failure leaves new metadata unloaded; retry works (R4.4)"),
        (MGMT + "test_count_changes_keep_the_parallel_lifecycle", "count changes 1->2->1->4->1"),
        (MGMT + "test_unregister_is_a_barrier_and_later_requests_get_404",
         "a later unregister retires the model: later waiters get 404, nothing reloads it"),
        (MGMT + "test_registration_is_visible_while_its_first_load_runs_and_duplicates_queue",
         "registration visible while loading; same-id registrations queue"),
    ],
    "F3": [
        (PAR + "test_failed_load_releases_everyone_and_a_retry_works",
         "injected weight-load failure releases every waiter; a retry loads"),
        (HTTP + "test_failed_load_leaves_the_model_registered_and_retries",
         "a broken checkpoint: registered, failed with backoff, retry works"),
        (PAR + "test_failed_session_creation_publishes_nothing",
         "the third slot's session fails after two were created (partial clone set): nothing published"),
        (PAR + "test_inference_failure_releases_its_slot_and_other_slots_keep_working",
         "injected inference failure frees its slot, other slots keep serving"),
        (BUDGET + "test_the_budget_refuses_decodes_that_do_not_fit_and_gives_every_reservation_back",
         "input preparation refused after the grant gives the lease back"),
        (HTTP + "test_bad_input_is_refused_and_leaves_the_model_free",
         "every kind of bad input is a 4xx and leaves the model free"),
        (WMEM + "test_teardown_releases_sessions_and_weights_even_while_the_pool_object_is_held",
         "teardown destroys sessions and weights even while the pool object is still referenced"),
        (SVC + "test_a_teardown_whose_manager_died_is_taken_over_by_the_next_manager",
         "a teardown whose manager died is taken over; ownership is not stranded"),
        (STREAM + "test_a_stream_refused_before_its_headers_is_a_plain_4xx_and_holds_nothing",
         "an abandoned, unstarted response holds no lease"),
        (SCHED + "test_lease_of_a_dead_holder_is_reclaimed_after_the_ttl",
         "a lease whose holder stops renewing is reclaimed"),
    ],
    "F4": [
        (HTTP + "test_client_that_leaves_while_queued_loses_its_ticket", "queued client leaves: ticket dropped"),
        (HTTP + "test_client_that_leaves_while_running_does_not_strand_the_lease",
         "running client leaves: the step finishes, the lease comes back"),
        (SCHED + "test_cancelled_waiter_loses_its_ticket_at_once", "cancelled waiter loses its ticket"),
        (SPEECH + "test_a_client_leaving_mid_stream_frees_the_slot_after_its_sentence",
         "a client leaving a live body frees the slot; its neighbour stays exact"),
        (STREAM + "test_an_sse_client_leaving_mid_stream_frees_the_slot_after_its_segment",
         "an SSE client leaving mid-stream frees the slot"),
        (OPS + "test_sigterm_drains_running_and_queued_work_inside_the_window_and_exits_0",
         "shutdown drains finite running and queued work and exits 0"),
        (OPS + "test_ctrl_c_with_a_window_too_short_answers_503_and_a_restart_runs_nothing_twice",
         "a drain window too short answers 503, nothing runs twice after restart"),
        (OPS + "test_a_speech_stream_cut_by_the_drain_deadline_ends_with_an_error_event",
         "a live body cut by the drain deadline ends with an error event, slot free"),
        (DRAIN + "test_a_view_still_running_at_the_deadline_is_answered_503_and_its_clean_up_runs",
         "a view still running at the deadline is answered 503 and cleans up"),
        (DRAIN + "test_a_stream_is_interrupted_at_the_deadline_and_items_before_it_pass",
         "a non-reading or slow stream is cut at the deadline"),
        (DRAIN + "test_wait_returns_when_the_last_connection_ends_and_a_handshake_during_the_drain_is_refused",
         "the drain waits for connections and refuses new handshakes"),
        (HARD + "test_the_proxy_drops_stalled_clients_and_never_hands_them_to_daphne",
         "stalled header and stalled body are dropped by the proxy, never reach daphne"),
        (SERVE + "test_serve_on_the_embedded_default_and_stop_on_ctrl_c",
         "Ctrl-C stops every child; no live resource destroyed early"),
    ],
    "F5": [
        (RES + "test_eviction_picks_the_idle_model_with_the_least_recent_use",
         "residency limits 1 and 2: LRU picks an idle model"),
        (RES + "test_a_cold_load_waits_for_room_and_never_evicts_a_busy_or_queued_model",
         "two models loading/running with limits 1 and 2: busy or queued models are never evicted"),
        (RES + "test_a_wave_of_requests_for_more_models_than_fit_loads_each_model_once",
         "more models than fit: each loads once"),
        (RES + "test_a_model_in_slow_teardown_does_not_count_toward_the_limit",
         "slow teardown clears residency first"),
        (RES + "test_warm_traffic_progresses_while_a_cold_load_holds_the_guard[limit2]",
         "unrelated warm requests flow while one model's load is blocked"),
        (MGMT + "test_bulk_unload_frees_an_idle_model_before_a_loading_one_finishes",
         "bulk unload frees an idle model before a loading one finishes"),
        (MGMT + "test_overlapping_reversed_and_duplicate_bulk_selections_do_not_deadlock",
         "overlapping, reversed and duplicate bulk selections do not deadlock"),
        (SCHED + "test_bulk_manager_publication_orders_overlapping_and_reversed_selections",
         "bulk publication orders overlapping and reversed selections at the scheduler"),
        (MGMT + "test_unload_drains_older_requests_clears_residency_first_and_is_idempotent",
         "status keeps answering during a held teardown; residency cleared first"),
        (MGMT + "test_operator_lifecycle_under_continuous_traffic_from_four_clients",
         "lifecycle operations under continuous traffic from four clients"),
    ],
}
# What the mapped tests do not show, said in the record (VALIDATION.md asks for honest limits).
LIMITS: dict[str, str] = {
    "F1": "",
    "F2": "",
    "F3": "destruction order (sessions before weights) is recorded by the fixture family and done by "
          "inference/worker/state.py but not asserted over HTTP; a failing 'preparation' is shown through "
          "the decode budget and bad input, there is no separate prepare hook",
    "F4": "stalled header and stalled body are handled by the nginx proxy in front of daphne (deploy/nginx), "
          "not by daphne alone; without nginx that test skips and F4 is PENDING",
    "F5": "",
}
# Skips of the whole suite that do not keep F6 from passing: cases that cannot apply by design.
EXPECTED_SKIPS: dict[str, str] = {
    RES + "test_warm_traffic_progresses_while_a_cold_load_holds_the_guard[limit1]":
        "needs room for two loaded models; the [limit2] case runs it",
}
DEFAULT_STRESS_STEPS = 100  # about 1.5 min on 2 cores, server start included


def mapped_node_ids(ids: tuple[str, ...] = ("F1", "F2", "F3", "F4", "F5")) -> list[str]:
    """Every node id mapped to the checks ``ids``, without repeats, in map order."""
    seen: dict[str, None] = {}
    for ident in ids:
        for node, _ in FRAMEWORK_TESTS[ident]:
            seen.setdefault(node, None)
    return list(seen)


def matches(mapped: str, node: str) -> bool:
    """True when collected/run ``node`` is ``mapped`` or one parametrized case of it."""
    return node == mapped or (node.startswith(mapped + "[") and "[" not in mapped)


def parse_junit(path: Path) -> dict[str, dict]:
    """Outcomes of a pytest JUnit XML file: ``{node id: {"outcome", "duration_s", "message"}}``.

    ``outcome`` is one of passed, failed, error, skipped; ``duration_s`` is pytest's time for the
    case in seconds (set-up and teardown included). The node id is rebuilt from ``classname``
    (``tests.test_x`` -> ``tests/test_x.py``) and ``name``.

    Raises:
        evidence.EvidenceError: the file is not JUnit XML.
    """
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as exc:
        raise evidence.EvidenceError(f"{path}: not a JUnit XML file ({exc})") from None
    cases: dict[str, dict] = {}
    for case in root.iter("testcase"):
        parts = case.get("classname", "").split(".")
        # classname is module[.Class]; modules here are tests.test_x
        module = "/".join(parts[:2]) + ".py" if len(parts) >= 2 else parts[0] + ".py"
        klass = "::".join(parts[2:])
        node = f"{module}::{klass + '::' if klass else ''}{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (found.get("message") or "")[:500]
                break
        # a failing teardown adds an <error> after a passed call: the worst outcome wins
        previous = cases.get(node)
        if previous and previous["outcome"] in ("failed", "error"):
            continue
        cases[node] = {"outcome": outcome, "duration_s": round(float(case.get("time") or 0), 3), "message": message}
    return cases


def check_status(entries: list[tuple[str, str]], outcomes: dict[str, dict],
                 expected_skips: dict[str, str] | None = None) -> tuple[str, list[dict], str]:
    """The status of one check from its mapped tests and a run's outcomes (rules in the module doc).

    Returns:
        ``(status, evidence rows, limits)``: one row per mapped test with the cases it matched
        (``node``, ``outcome``, ``duration_s``, ``message``) and its note.
    """
    expected_skips = expected_skips or {}
    rows, failed, skipped, missing = [], [], [], []
    for mapped, note in entries:
        cases = [{"node": node, **result} for node, result in outcomes.items() if matches(mapped, node)]
        rows.append({"test": mapped, "proves": note, "cases": cases})
        if not cases:
            missing.append(mapped)
        for case in cases:
            if case["outcome"] in ("failed", "error"):
                failed.append(case["node"])
            elif case["outcome"] == "skipped" and case["node"] not in expected_skips:
                skipped.append(case["node"])
    if failed or missing:
        why = [f"failed: {', '.join(failed)}"] if failed else []
        why += [f"not found in the run: {', '.join(missing)}"] if missing else []
        return evidence.FAIL, rows, "; ".join(why)
    if skipped:
        return evidence.PENDING, rows, f"skipped (a skip is not a pass): {', '.join(skipped)}"
    return evidence.PASS, rows, ""


def _summary(outcomes: dict[str, dict]) -> dict:
    counts = {"tests": len(outcomes), "passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for result in outcomes.values():
        counts[result["outcome"]] += 1
    counts["duration_s"] = round(sum(r["duration_s"] for r in outcomes.values()), 1)
    return counts


def _pytest(argv: list[str], junit: Path, log: Path, out: TextIO) -> int:
    """Run pytest in a child process (the suite starts its own servers); returns its exit code."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *argv]
    out.write(f"running: {' '.join(command[:8])} … ({len(argv)} argument(s)); log: {log}\n")
    out.flush()
    env = {**os.environ, "AUDIOSITE_REQUIRE_SERVICES": os.environ.get("AUDIOSITE_REQUIRE_SERVICES", "1"),
           "HF_HUB_OFFLINE": "1"}
    with open(log, "wb") as handle:
        done = subprocess.run(command, cwd=settings.BASE_DIR, env=env, stdout=handle, stderr=subprocess.STDOUT)
    return done.returncode


def run(backend: str, out_root: Path, seed: int | None = None, stress_steps: int = DEFAULT_STRESS_STEPS,
        stdout: TextIO | None = None, quick: bool = False) -> Path:
    """Run the framework checks and write one framework record under ``out_root``; returns its path.

    ``quick``: only the mapped F1–F5 tests (F6 PENDING). Otherwise the whole suite (which contains
    the mapped tests) and then a seeded stress run of ``stress_steps`` steps (``seed`` None: a random
    seed, printed and recorded). The test suite needs its services (PostgreSQL, Redis: README, "Set
    up"), taken from ``DATABASE_URL`` / ``REDIS_URL`` as for ``scripts/test.sh``.

    Raises:
        ValueError: ``backend`` is not the backend this machine resolves to ('cuda' on a machine
            whose onnxruntime gets no CUDA provider, for instance): the record would claim a scope
            it did not run.
    """
    stdout = stdout or sys.stdout
    found = resolve_backend("auto")
    if backend != found:
        raise ValueError(f"backend {backend!r} requested but this machine runs models on {found!r}; "
                         f"a framework record must be made on the backend it names")
    started_at, began = evidence.now_iso(), time.monotonic()
    scope = evidence.manifest(backend)  # read before the run: the code the tests exercise
    out_root = Path(out_root).resolve()  # pytest runs in BASE_DIR, maybe not the caller's directory
    rid = evidence.run_id("framework", backend)
    folder = out_root / backend / "framework" / rid
    folder.mkdir(parents=True, exist_ok=True)
    junit, log = folder / "junit.xml", folder / "pytest.log"
    argv = mapped_node_ids() if quick else ["tests"]
    code = _pytest(argv, junit, log, stdout)
    outcomes = parse_junit(junit) if junit.exists() else {}
    stdout.write(f"pytest exit {code}: {_summary(outcomes)}\n")
    checks = {}
    for ident in ("F1", "F2", "F3", "F4", "F5"):
        status, rows, why = check_status(FRAMEWORK_TESTS[ident], outcomes)
        limits = "; ".join(part for part in (why, LIMITS[ident]) if part)
        checks[ident] = evidence.check(status, {"tests": rows, "junit": "junit.xml"}, limits)
    stress_report = None
    if quick:
        checks["F6"] = evidence.check(evidence.PENDING, {"suite": _summary(outcomes)},
                                      "quick run: only the mapped F1-F5 tests ran; the whole suite and "
                                      "the seeded stress run did not")
    else:
        seed = random.SystemRandom().randrange(1, 2**31) if seed is None else seed
        stress_report = run_stress(seed, stress_steps, stdout=stdout, workdir=folder / "stress")
        checks["F6"] = _whole_suite_and_stress_pass(outcomes, code, stress_report)
    record = {
        "procedure_version": evidence.PROCEDURE_VERSION, "kind": "framework", "run_id": rid,
        "started_at": started_at, "finished_at": evidence.now_iso(), "duration_s": round(time.monotonic() - began, 1),
        "manifest": {**scope, "scope": {
            "quick": quick, "pytest_args": argv if quick else ["tests"], "pytest_exit": code,
            "suite": _summary(outcomes), "stress_seed": stress_report["seed"] if stress_report else None,
            "stress_steps": stress_report["steps"] if stress_report else None,
            "database": _redacted(os.environ.get("DATABASE_URL", "")),
            "redis": _redacted(os.environ.get("REDIS_URL", ""))}},
        "framework_checks": checks, "model_checks": {}, "counts": {},
        "admission_ready": evidence.all_pass(checks), "performance": {},
    }
    path = evidence.write(out_root, record)
    if log.stat().st_size > 2_000_000:  # a failing full run can be long; keep the end
        log.write_bytes(log.read_bytes()[-2_000_000:])
    for ident, entry in checks.items():
        stdout.write(f"{ident} {entry['status']:<8} {entry['limits']}\n")
    stdout.write(f"framework record: {path}\n")
    return path


def _whole_suite_and_stress_pass(outcomes: dict[str, dict], code: int, stress_report: dict) -> dict:
    """F6: the whole suite passed (no failure or error, at least one test ran) and the seeded stress run
    found no violation; an unexpected skip (not in ``EXPECTED_SKIPS``) makes it PENDING, not PASS.

    ``outcomes`` is :func:`parse_junit`'s node id -> ``{"outcome", ...}``; ``code`` pytest's exit code;
    ``stress_report`` :func:`gate.stress.run_stress`'s report. Returns the F6 check."""
    suite = _summary(outcomes)
    bad = [n for n, r in outcomes.items() if r["outcome"] in ("failed", "error")]
    skips = [n for n, r in outcomes.items() if r["outcome"] == "skipped" and n not in EXPECTED_SKIPS]
    stress = {k: stress_report[k] for k in ("seed", "steps", "requests", "managers", "violations", "duration_s",
                                            "statuses")}
    found = {"suite": suite, "failed": bad, "skipped": skips, "expected_skips": EXPECTED_SKIPS, "stress": stress,
             "junit": "junit.xml", "stress_report": "stress/stress.json"}
    if bad or not outcomes or stress_report["violations"]:
        why = []
        if bad:
            why.append(f"{len(bad)} test(s) failed")
        if not outcomes:
            why.append(f"pytest ran no test (exit {code})")
        if stress_report["violations"]:
            why.append(f"{len(stress_report['violations'])} stress violation(s), seed {stress_report['seed']}")
        return evidence.check(evidence.FAIL, found, "; ".join(why))
    if skips:
        return evidence.check(evidence.PENDING, found, f"skipped (a skip is not a pass): {', '.join(skips)}")
    return evidence.check(evidence.PASS, found, "")


def _redacted(url: str) -> str:
    """``url`` without a password (scheme://user@host:port/db)."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    creds, _, where = rest.rpartition("@")
    return f"{scheme}://{creds.split(':', 1)[0]}@{where}"
