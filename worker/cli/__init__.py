"""The ``agent-worker`` command line: runner, frontend, admin and demo subcommands."""
