//! Integration tests live under `tests/tests/`.
