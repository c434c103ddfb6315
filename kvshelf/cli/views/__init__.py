"""What the commands show and run, beyond parsing their flags: the admin tables and plot (``admin``), the KV-event
lines of ``kvshelf events`` (``event_format``) and the demo's job (``demo_job``). These import the store, torch or
protobuf at module level, so the command modules import them inside the commands, never at module level
(``kvshelf --help`` stays light: tests/test_dependencies.py)."""
