"""The validation gate (``docs/validation.md``; ../shared/spec/VALIDATION.md): evidence records, the
model checks M1–M6, the framework record F1–F6 and the admission table built from records (CONTRACT R9.2).

A tool, not the product: its commands (``validate_slots``, ``validate_framework``, ``admission``)
start real servers and read or write ``model_specs/evidence`` and ``model_specs/admission``. The gate
imports the product (``inference.specs``, the scheduler's key builder); the serving code never imports
the gate (``tests/test_layout.py``). The server reads only the table file the gate writes.
"""
