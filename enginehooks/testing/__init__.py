"""Helpers for the demo, tests and benchmarks, not for production: tiny models built
offline, real engine servers started as child processes, and the demo itself. No
other part of the library imports it (the `enginehooks demo` command runs it)."""
