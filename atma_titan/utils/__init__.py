"""Small helpers every part uses: the bad-input error and optional imports (errors), whole-file writes
(atomic), the device policy (device), credentials out of URLs (redact), lazily imported package names
(lazy_exports), the warnings every command silences (known_warnings) and what every command shares:
its parser, the checkpoint flags, its exit on bad input (cli)."""
