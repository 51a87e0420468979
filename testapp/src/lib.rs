//! Helpers for tests to locate the test application binary.
