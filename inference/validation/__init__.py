"""The validation gate (../shared/spec/VALIDATION.md): evidence records, the model checks M1–M6,
the framework record F1–F6 and the admission table built from records (CONTRACT R9.2)."""
